"""Real services, started once per test session: a redis-server, a Celery worker holding the default model, the API."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
import torch

from shared.cli import api_command, worker_command
from shared.embedded_redis import EmbeddedRedis, free_port
from shared.settings import Settings
from worker.render import Renderer

ROOT = Path(__file__).resolve().parent.parent

# Triton decides when it is first imported whether its kernels compile for a GPU or run in its interpreter; on a
# machine without one, the interpreter lets the tests run the CUDA kernels on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), persist=False).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def settings(redis_server: EmbeddedRedis) -> Settings:
    # Keep-alives four times a second: the streaming tests then read streams with keep-alives among their events.
    return Settings(redis_url=redis_server.url, api_port=free_port(), worker_concurrency=32, sse_keepalive=0.25)


def _env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CHATQ_REDIS_URL=settings.redis_url,
        CHATQ_API_PORT=str(settings.api_port),
        CHATQ_WORKER_CONCURRENCY=str(settings.worker_concurrency),
        CHATQ_SSE_KEEPALIVE=str(settings.sse_keepalive),
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture(scope="session")
def stack(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API's base URL, once the API answers and a worker has registered for the model."""
    logs = tmp_path_factory.mktemp("logs")
    procs = []
    for name, command in (("worker", worker_command(settings)), ("api", api_command(settings))):
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115  (closed with the process below)
        procs.append(
            (subprocess.Popen(command, env=_env(settings), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), out)
        )
    base = f"http://{settings.api_host}:{settings.api_port}"
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
    for p, _ in procs:
        p.terminate()
    for p, out in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
        out.close()


@pytest.fixture(scope="session")
def client(stack: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(stack: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def r(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url, decode_responses=True)


@pytest.fixture(scope="session")
def renderer(settings: Settings) -> Renderer:
    return Renderer(settings.model_dir)


@pytest.fixture(scope="session")
def model_name(settings: Settings) -> str:
    return settings.model_name
