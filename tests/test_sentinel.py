"""Redis Sentinel: a master, a replica and three sentinels, all real processes, and chatq (the API with its relay's
pub/sub, a real worker and its Celery broker) given only the sentinels' addresses. The master is killed (SIGKILL)
while jobs run and others wait: the sentinels promote the replica, every process finds it, and nothing is lost."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from pydantic import SecretStr
from redis.backoff import NoBackoff
from redis.retry import Retry

from chatq.core import keys
from chatq.core.redis_url import sync_client
from chatq.core.settings import Settings
from chatq.embedded_redis import free_port, redis_server_binary
from tests.helpers import frames, running_stack, wait_for
from tests.test_faults import LONG, Reading, resume
from tests.test_redis_security import FLOWER_AUTH, flower

MASTER = "chatq"
PASSWORD = "s3nt1nel-master"
SENTINEL_PASSWORD = "s3nt1nel-own"
# Quick to notice a dead master and to give up a stuck failover, so the test waits seconds, not minutes.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 4000


@dataclass
class Cluster:
    """A master and a replica (ports), three sentinels watching them, each a redis-server process."""

    tmp: Path
    ports: list[int] = field(default_factory=list)  # master, replica
    sentinel_ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"sentinel://:{PASSWORD}@{hosts}/{MASTER}/0?sentinel_password={SENTINEL_PASSWORD}"

    def start_redis(self, port: int, *args: str) -> None:
        auth = ["--requirepass", PASSWORD, "--masterauth", PASSWORD]
        base = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.tmp), "--save", "", "--appendonly", "no"]
        self._spawn(port, [redis_server_binary(), *base, *auth, "--dbfilename", f"{port}.rdb", *args])

    def start_sentinel(self, port: int) -> None:
        conf = self.tmp / f"sentinel-{port}.conf"  # a sentinel rewrites its file with what it learns
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.tmp}\nrequirepass {SENTINEL_PASSWORD}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.ports[0]} 2\n"
            f"sentinel auth-pass {MASTER} {PASSWORD}\nsentinel sentinel-pass {SENTINEL_PASSWORD}\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
        )
        self._spawn(port, [redis_server_binary(), str(conf), "--sentinel"])

    def _spawn(self, port: int, args: list[str]) -> None:
        log = open(self.tmp / f"{port}.log", "wb")  # noqa: SIM115  (the process holds it)
        self.procs[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def client(self, port: int, password: str = PASSWORD) -> redis.Redis:
        return redis.Redis(port=port, password=password, decode_responses=True, socket_timeout=2)

    def master_port(self) -> int:
        """The master's port as every sentinel names it; fails while they disagree."""
        named = {
            int(self.client(p, SENTINEL_PASSWORD).sentinel_get_master_addr_by_name(MASTER)[1])
            for p in self.sentinel_ports
        }
        assert len(named) == 1, named
        return named.pop()

    def kill_master(self) -> int:
        port = self.ports[0]
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(timeout=10)
        return port

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def until(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, AssertionError):
            if check():
                return
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@contextlib.contextmanager
def sentinel_cluster(tmp: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp, [free_port(), free_port()], [free_port() for _ in range(3)])
    try:
        master, replica = cluster.ports
        cluster.start_redis(master)
        cluster.start_redis(replica, "--replicaof", "127.0.0.1", str(master))

        def replicating() -> bool:
            return cluster.client(replica).info("replication")["master_link_status"] == "up"

        until(replicating, 30, "the replica never synced")
        for port in cluster.sentinel_ports:
            cluster.start_sentinel(port)

        def watching() -> bool:  # each knows the replica and the two other sentinels: a failover can be agreed
            for p in cluster.sentinel_ports:
                sentinel = cluster.client(p, SENTINEL_PASSWORD)
                if len(sentinel.sentinel_sentinels(MASTER)) < 2 or not sentinel.sentinel_slaves(MASTER):
                    return False
            return True

        until(watching, 30, "the sentinels never found one another and the replica")
        yield cluster
    finally:
        cluster.stop()


def test_a_sentinel_url_reaches_the_master_for_chatq_and_for_flower(tmp_path: Path) -> None:
    with sentinel_cluster(tmp_path) as cluster:
        client = sync_client(cluster.url, decode_responses=True)
        client.set("probe", "1")
        assert cluster.client(cluster.ports[0]).get("probe") == "1"  # written on the master, not the replica
        settings = Settings(redis_url=cluster.url, flower_port=free_port(), flower_auth=SecretStr(FLOWER_AUTH))
        queue = keys.celery_queue(settings.model_name)
        client.rpush(queue, "a message no worker takes")
        with flower(settings, tmp_path / "flower.log") as base:  # Flower reads queue lengths from the master itself
            lengths = httpx.get(f"{base}/api/queues/length", auth=tuple(FLOWER_AUTH.split(":")), timeout=30)
            assert lengths.status_code == 200, lengths.text
            assert {"name": queue, "messages": 1} in lengths.json()["active_queues"]
        assert SENTINEL_PASSWORD not in (tmp_path / "flower.log").read_text()
        wrong = cluster.url.replace(SENTINEL_PASSWORD, "not-it")
        with pytest.raises(redis.ConnectionError):  # no sentinel answers: no master is found
            sync_client(wrong, retry=Retry(NoBackoff(), 0)).ping()


BACKGROUND = {
    "messages": [{"role": "user", "content": "Count to fifty."}],
    "max_tokens": 12,
    "ignore_eos": True,
    "temperature": 0,
    "background": True,
}
STREAMED = LONG | {"max_tokens": 60, "stream": True}


def read_stream(http: httpx.Client, reading: Reading, job: list[str], errors: list[BaseException]) -> None:
    """A streaming request, read to its end across the failover, resumed from the log if its connection broke.
    `job` gets the job's id once the stream is under way."""
    try:
        with (
            contextlib.suppress(httpx.TransportError),
            http.stream("POST", "/v1/chat/completions", json=STREAMED) as resp,
        ):
            reading.read(resp, stop_after=5)
            job.append(reading.frames[-1].json["id"])
            reading.read(resp)
        resume(http, job[0], reading, time.monotonic() + 240)
    except BaseException as e:  # the main thread fails the test with it
        errors.append(e)


def assert_log_whole(http: httpx.Client, job_id: str, tokens: int) -> list[int]:
    """The job completed once: its event log, read back, numbers each event once and in order and spells its text.
    The log's event ids."""
    job = wait_for(http, job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), 240)
    assert job["status"] == "completed", job
    assert job["usage"]["completion_tokens"] == tokens, job
    with http.stream("GET", f"/v1/chat/completions/{job_id}?stream=true") as resp:
        assert resp.status_code == 200
        got = [f for f in frames(resp.iter_lines()) if f.data != "[DONE]"]
    ids = [f.id for f in got if f.id is not None]
    assert ids == list(range(1, len(ids) + 1)), ids
    text = "".join(c["delta"].get("content") or "" for f in got for c in f.json["choices"])
    assert text == job["choices"][0]["message"]["content"]
    return ids


@pytest.mark.timeout(600)
def test_jobs_queued_and_running_survive_the_master_being_killed(tmp_path: Path) -> None:
    with sentinel_cluster(tmp_path) as cluster:
        # Two jobs at once: the stream and one background job run, the others wait in the queue.
        settings = Settings(redis_url=cluster.url, api_port=free_port(), worker_concurrency=2, sse_keepalive=0.25)
        with running_stack(settings, tmp_path) as base, httpx.Client(base_url=base, timeout=60) as http:
            reading, job, errors = Reading(), [], []
            reader = threading.Thread(target=read_stream, args=(http, reading, job, errors), daemon=True)
            reader.start()
            until(lambda: job or errors, 120, "the stream never started")
            ids = [http.post("/v1/chat/completions", json=BACKGROUND).json()["id"] for _ in range(6)]
            queued = [j for j in ids if http.get(f"/v1/chat/completions/{j}").json()["status"] == "queued"]
            assert len(queued) >= 2  # some have not reached the worker when the master goes

            cluster.kill_master()
            until(lambda: cluster.master_port() == cluster.ports[1], 60, "the sentinels never promoted the replica")

            reader.join(300)
            assert not reader.is_alive() and not errors, errors
            assert reading.event_ids() == assert_log_whole(http, job[0], STREAMED["max_tokens"])
            for job_id in ids:
                assert_log_whole(http, job_id, BACKGROUND["max_tokens"])
            # New requests go to the new master, both ways.
            after = http.post("/v1/chat/completions", json=BACKGROUND | {"background": False})
            assert after.status_code == 200, after.text
            assert after.json()["usage"]["completion_tokens"] == BACKGROUND["max_tokens"]
            streamed = Reading()
            with http.stream("POST", "/v1/chat/completions", json=STREAMED | {"max_tokens": 8}) as resp:
                streamed.read(resp)
            assert streamed.ended and streamed.event_ids() == list(range(1, len(streamed.event_ids()) + 1))
