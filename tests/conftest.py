"""Real services, started once per test session: a redis-server, a Celery worker holding the default model, the API."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
import torch

from chatq.core.model_info import ModelInfo
from chatq.core.render import Renderer
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import S3Server, running_stack, s3_server

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
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3-compatible server, for the S3 file store."""
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(scope="session")
def settings(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    # Keep-alives four times a second: the streaming tests then read streams with keep-alives among their events.
    # The worker serves its metrics (tests/worker/test_metrics.py). Files go to a directory of the session's own.
    return Settings(
        redis_url=redis_server.url,
        api_port=free_port(),
        worker_concurrency=32,
        sse_keepalive=0.25,
        worker_metrics_port=free_port(),
        files_dir=tmp_path_factory.mktemp("files"),
    )


@pytest.fixture(scope="session")
def stack(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API's base URL, once the API answers and a worker has registered for the model."""
    with running_stack(settings, tmp_path_factory.mktemp("logs")) as base:
        yield base


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
    return Renderer(ModelInfo.read(settings.model_name, settings.model_dir))


@pytest.fixture(scope="session")
def model_name(settings: Settings) -> str:
    return settings.model_name
