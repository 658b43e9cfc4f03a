"""Faults a deployment meets, with real processes and real signals: Redis shut down and started again (queued jobs
and a running stream), and the API killed in the middle of a stream. Nothing is lost: every job completes, and a
client that resumes with Last-Event-ID ends with every event once, in order.

Each test runs its own Redis (AOF on, as `chatq up` runs it) and its own processes, so killing them disturbs no one.
The recovery times are printed (pytest -s shows them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from chatq.cli import api_command, worker_command
from chatq.core.registry import entry, register
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import ROOT, Frame, frames, model_info, wait_for

LONG = {
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 200,
    "ignore_eos": True,
    "temperature": 0,
}


@dataclass
class Proc:
    popen: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def spawn(name: str, command: list[str], settings: Settings, logs: Path) -> Proc:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CHATQ_REDIS_URL=settings.redis_url)
    env |= {"CHATQ_API_PORT": str(settings.api_port), "CHATQ_WORKER_CONCURRENCY": str(settings.worker_concurrency)}
    log = logs / f"{name}.log"
    with open(log, "ab") as out:
        popen = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return Proc(popen, log)


def wait_answers(url: str, procs: list[Proc], timeout: float = 180) -> float:
    """Seconds until `url` answers 200; fails with the logs if a process died first."""
    start = time.monotonic()
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        if any(p.popen.poll() is not None for p in procs) or time.monotonic() - start > timeout:
            raise AssertionError("\n".join(p.log.read_text()[-3000:] for p in procs))
        time.sleep(0.05)


@dataclass
class Stack:
    server: EmbeddedRedis
    settings: Settings
    procs: dict[str, Proc]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.settings.api_port}"

    def restart_redis(self, down_for: float = 0.0) -> float:
        """SHUTDOWN (Redis writes its AOF and exits), `down_for` seconds with no Redis, then a new redis-server on
        the same port and data directory; the seconds the restart took."""
        start = time.monotonic()
        # No retries: redis-py would otherwise spend seconds reconnecting to the server it just shut down.
        with contextlib.suppress(redis.ConnectionError):
            redis.Redis(port=self.server.port, retry=Retry(NoBackoff(), 0)).shutdown()
        assert self.server.proc is not None and self.server.proc.wait(timeout=20) == 0
        time.sleep(down_for)
        self.server = EmbeddedRedis(self.server.data_dir, port=self.server.port, persist=True).start()
        assert self.server.url == self.settings.redis_url  # the same port: every process reconnects to it
        return time.monotonic() - start

    def start(self, name: str) -> Proc:
        command = {"api": api_command, "worker": worker_command}[name](self.settings)
        self.procs[name] = spawn(name, command, self.settings, self.server.data_dir.parent)
        return self.procs[name]


@contextlib.contextmanager
def services(tmp: Path, worker: bool = True) -> Iterator[Stack]:
    """Redis with AOF on, the API and (unless not) a worker; everything is stopped on the way out."""
    server = EmbeddedRedis(tmp / "redis", persist=True).start()
    settings = Settings(redis_url=server.url, api_port=free_port(), worker_concurrency=8, sse_keepalive=0.25)
    stack = Stack(server, settings, {})
    try:
        for name in ("api", "worker") if worker else ("api",):
            stack.start(name)
        wait_answers(f"{stack.base}/{'health' if worker else 'version'}", list(stack.procs.values()))
        yield stack
    finally:
        for p in stack.procs.values():
            p.stop()
        stack.server.stop()


@dataclass
class Reading:
    """A client's view of one job's stream across reconnections: every frame, and when each came."""

    frames: list[Frame] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    connections: int = 0
    _response: httpx.Response | None = None
    _frames: Iterator[Frame] = iter(())

    @property
    def last_id(self) -> int:
        return max((f.id for f in self.frames if f.id is not None), default=0)

    @property
    def ended(self) -> bool:
        return bool(self.frames) and self.frames[-1].data == "[DONE]" and not self._errored

    @property
    def _errored(self) -> bool:
        return any(f.data != "[DONE]" and "error" in f.json for f in self.frames[-2:])

    def read(self, response: httpx.Response, stop_after: int | None = None) -> None:
        """Reads frames until the stream ends, or until `stop_after` events have come in all; read again, the same
        response goes on where it stopped."""
        if response is not self._response:
            assert response.status_code == 200, response.read()
            self.connections += 1
            self._response, self._frames = response, frames(response.iter_lines())
        for frame in self._frames:
            self.frames.append(frame)
            self.times.append(time.monotonic())
            if stop_after is not None and self.last_id >= stop_after:
                return

    def text(self) -> str:
        events = [f.json for f in self.frames if f.data != "[DONE]" and "error" not in f.json]
        return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])

    def event_ids(self) -> list[int]:
        """The ids of the events kept: an error frame that ended a connection, and its [DONE], carry the last id
        again (to resume from) and are not events of the job."""
        return [f.id for f in self.frames if f.id is not None and f.data != "[DONE]" and "error" not in f.json]


def resume(http: httpx.Client, job_id: str, reading: Reading, deadline: float) -> None:
    """Reconnects with Last-Event-ID until the stream ends with the job's [DONE]."""
    while not reading.ended:
        assert time.monotonic() < deadline, reading.frames[-3:]
        try:
            with http.stream(
                "GET", f"/v1/chat/completions/{job_id}?stream=true", headers={"Last-Event-ID": str(reading.last_id)}
            ) as resp:
                if resp.status_code == 204:  # every event was had already
                    return
                if resp.status_code == 503:  # Redis not back yet
                    time.sleep(0.2)
                    continue
                reading.read(resp)
        except httpx.TransportError:
            time.sleep(0.2)


def assert_whole(http: httpx.Client, job_id: str, reading: Reading) -> None:
    job = wait_for(http, job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"))
    assert job["status"] == "completed", job
    ids = reading.event_ids()
    assert ids == list(range(1, len(ids) + 1)), ids  # nothing repeated, nothing missing
    assert job["usage"]["completion_tokens"] == LONG["max_tokens"], job
    assert reading.text() == job["choices"][0]["message"]["content"]


def test_jobs_queued_before_a_redis_restart_all_complete(tmp_path: Path) -> None:
    with services(tmp_path, worker=False) as stack, httpx.Client(base_url=stack.base, timeout=30) as http:
        # The model's entry, as a worker that ran before and stopped left it: its background jobs wait for the next.
        register(redis.Redis.from_url(stack.settings.redis_url, decode_responses=True), entry(model_info()))
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "background": True}
        ids = [http.post("/v1/chat/completions", json=body).json()["id"] for _ in range(5)]
        took = stack.restart_redis()
        print(f"\nRedis SHUTDOWN and started again in {took:.2f} s")
        stack.start("worker")
        for job_id in ids:
            job = wait_for(http, job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), 180)
            assert job["status"] == "completed", job


def test_a_stream_goes_on_through_a_redis_restart(tmp_path: Path) -> None:
    with services(tmp_path) as stack, httpx.Client(base_url=stack.base, timeout=60) as http:
        reading = Reading()
        with http.stream("POST", "/v1/chat/completions", json=LONG | {"stream": True}) as resp:
            reading.read(resp, stop_after=20)
            job_id = reading.frames[-1].json["id"]
            took = stack.restart_redis(down_for=2.0)  # an outage the clients' reconnect backoff has to ride out
            back, seen = time.monotonic(), len(reading.frames)
            reading.read(resp)
        resume(http, job_id, reading, time.monotonic() + 180)
        first = next((t - back for t in reading.times[seen:] if t > back), float("nan"))
        print(f"\nRedis restarted in {took:.2f} s; first event {first:.2f} s after it was back;", end=" ")
        print(f"{reading.connections} connection(s), {len(reading.event_ids())} events")
        assert_whole(http, job_id, reading)
        assert reading.connections == 1  # the stream waited for Redis and went on: the client had nothing to do


def test_a_stream_resumes_on_a_new_api_after_the_old_one_was_killed(tmp_path: Path) -> None:
    with services(tmp_path) as stack, httpx.Client(base_url=stack.base, timeout=60) as http:
        job_id = http.post("/v1/chat/completions", json=LONG | {"background": True}).json()["id"]
        reading = Reading()
        killed = 0.0
        with (
            contextlib.suppress(httpx.TransportError),
            http.stream("GET", f"/v1/chat/completions/{job_id}?stream=true") as resp,
        ):
            reading.read(resp, stop_after=20)
            stack.procs["api"].popen.send_signal(signal.SIGKILL)
            stack.procs["api"].popen.wait(timeout=10)
            killed = time.monotonic()
            reading.read(resp)  # what was still in flight, then the connection breaks
        up = wait_answers(f"{stack.base}/version", [stack.start("api")])
        seen = len(reading.frames)
        resume(http, job_id, reading, time.monotonic() + 180)
        first = reading.times[seen] - killed if len(reading.times) > seen else float("nan")
        print(f"\nnew API answered {up:.2f} s after it started; first resumed event {first:.2f} s after the kill")
        assert_whole(http, job_id, reading)
