"""Small helpers the tests share: reading SSE frames, waiting on a job, running a parser over pieces of text."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis

from chatq.api.jobs import JobStore
from chatq.cli import api_command, worker_command
from chatq.core import keys
from chatq.core.delta import Delta
from chatq.core.errors import JobNotFound
from chatq.core.model_info import ModelInfo
from chatq.core.queue import make_celery
from chatq.core.settings import Settings
from chatq.worker.parse import Message, Parser

ROOT = Path(__file__).resolve().parent.parent


def model_info(max_model_len: int = 0, eos_token_ids: tuple[int, ...] | None = None) -> ModelInfo:
    """The default model's facts, with its context length and EOS ids as a test needs them."""
    info = _default_model()
    info = dataclasses.replace(info, max_model_len=max_model_len) if max_model_len else info
    return info if eos_token_ids is None else dataclasses.replace(info, eos_token_ids=eos_token_ids)


@functools.cache
def _default_model() -> ModelInfo:
    return ModelInfo.read(Settings().model_name, Settings().model_dir)


def alive(pid: int | str) -> bool:
    """Whether the process runs: one killed but not yet reaped by whoever inherited it is a zombie, not alive."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CHATQ_REDIS_URL=settings.redis_url,
        CHATQ_API_PORT=str(settings.api_port),
        CHATQ_WORKER_CONCURRENCY=str(settings.worker_concurrency),
        CHATQ_SSE_KEEPALIVE=str(settings.sse_keepalive),
        CHATQ_API_KEYS=settings.api_keys.get_secret_value(),
        CHATQ_MAX_QUEUED=str(settings.max_queued),
        CHATQ_MAX_BODY_BYTES=str(settings.max_body_bytes),
        CHATQ_WORKER_METRICS_PORT=str(settings.worker_metrics_port),
        PYTHONUNBUFFERED="1",
    )
    return env


@contextlib.contextmanager
def running_stack(settings: Settings, logs: Path) -> Iterator[str]:
    """A worker and an API on `settings`' Redis; the API's base URL once it is healthy."""
    procs = []
    for name, command in (("worker", worker_command(settings)), ("api", api_command(settings))):
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115  (closed with the process below)
        procs.append(
            (subprocess.Popen(command, env=_env(settings), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), out)
        )
    base = f"http://{settings.api_host}:{settings.api_port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            dead = [p for p, _ in procs if p.poll() is not None]
            if dead or time.time() > deadline:
                for name in ("worker", "api"):
                    sys.stderr.write((logs / f"{name}.log").read_text()[-3000:])
                raise RuntimeError("the chatq stack did not become healthy")
            time.sleep(0.5)
        yield base
    finally:
        for p, _ in procs:
            p.terminate()
        for p, out in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
            out.close()


@dataclass
class Frame:
    id: int | None
    data: str

    @property
    def json(self) -> dict[str, Any]:
        return json.loads(self.data)


def frames(lines: Iterator[str]) -> Iterator[Frame]:
    """Parses an SSE body line by line; comments (pings) are skipped."""
    event_id, data = None, []
    for line in lines:
        if line == "":
            if data:
                yield Frame(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def stream(http: httpx.Client, method: str, url: str, **kw: Any) -> list[Frame]:
    with http.stream(method, url, **kw) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return list(frames(resp.iter_lines()))


def content_of(fs: list[Frame], index: int = 0) -> str:
    out = []
    for f in fs:
        if f.data == "[DONE]":
            continue
        for c in f.json.get("choices", []):
            if c["index"] == index:
                out.append(c["delta"].get("content") or "")
    return "".join(out)


def wait_for(http: httpx.Client, job_id: str, until: Callable[[dict[str, Any]], bool], timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while True:
        job = http.get(f"/v1/chat/completions/{job_id}").json()
        if until(job):
            return job
        assert time.time() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.05)


def snapshot(r: redis.Redis, model: str) -> tuple[int, int, int]:
    """What a refused request must leave unchanged: job records, the Celery queue and the waiting set."""
    jobs = sum(1 for k in r.scan_iter(keys.job("*")) if k.count(":") == keys.job("").count(":"))
    queued = sum(r.llen(k) for k in r.scan_iter(keys.celery_queue(model) + "*"))
    return jobs, queued, r.zcard(keys.waiting(model))


def cancel_job(settings: Settings, job_id: str, delete: bool = False) -> None:
    """The API's cancel (or delete) of a job, without HTTP."""

    async def cancel() -> None:
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        try:
            await JobStore(client, make_celery(settings), settings).cancel(job_id, delete)
        finally:
            await client.aclose()

    asyncio.run(cancel())


def quiesce(r: redis.Redis, settings: Settings, timeout: float = 60) -> None:
    """Cancels the model's queued and running jobs (left by earlier tests: background jobs outlive their test) and
    waits until none is left, so what a test counts next is its own jobs' doing."""
    model = settings.model_name
    for job_id in {*r.zrange(keys.waiting(model), 0, -1), *r.smembers(keys.running(model))}:
        with contextlib.suppress(JobNotFound):  # it ended meanwhile, and expired
            cancel_job(settings, job_id)
    deadline = time.time() + timeout
    while r.zcard(keys.waiting(model)) or r.scard(keys.running(model)):
        assert time.time() < deadline, "the model's jobs did not end"
        time.sleep(0.05)


def assert_error(resp: httpx.Response, status: int, type_: str, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (type_, param, status), error
    assert error["message"]
    return error


def combine(deltas: Iterable[Delta]) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """Deltas of one choice -> (content, reasoning, tool_calls), as the worker builds a final message."""
    message = Message()
    for d in deltas:
        message.add(d)
    return message.result()


def collect(parser: Parser, pieces: Iterable[str]) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """Feed every piece, finish, and combine: the whole parsed message."""
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return combine(deltas)
