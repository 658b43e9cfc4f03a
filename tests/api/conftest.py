"""A second stack for the API's guards: API keys set, a small cap on waiting jobs and a worker of two task threads,
which two long jobs keep busy. It has its own Redis, so its queue holds only its own tests' jobs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import running_stack

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
ADMIN = "admin-key-5555555555"


@dataclass
class Guarded:
    settings: Settings
    base: str
    r: redis.Redis
    logs: Path

    def client(self, key: str | None = KEY_A) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=120)


@pytest.fixture(scope="session")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("guarded-redis"), persist=False).start()
    settings = Settings(
        redis_url=server.url,
        api_port=free_port(),
        worker_concurrency=2,
        sse_keepalive=0.25,
        api_keys=f"{KEY_A}, {KEY_B}",
        admin_key=ADMIN,
        max_queued=3,
    )
    logs = tmp_path_factory.mktemp("guarded-logs")
    try:
        with running_stack(settings, logs) as base:
            yield Guarded(settings, base, redis.Redis.from_url(server.url, decode_responses=True), logs)
    finally:
        server.stop()
    assert "open to anyone" not in (logs / "api.log").read_text()
