"""The workers' broker transport: kombu's Redis transport, with one client per connection pool, that outlives Redis
going away."""

from __future__ import annotations

import time

import httpx
import pytest
from kombu import Connection

from chatq.core.broker import RedisTransport
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import running_stack, stream, wait_for


def test_one_client_serves_every_delivery_and_ack(settings: Settings) -> None:
    with Connection(settings.redis_url, transport=RedisTransport) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
        assert first.ping()


@pytest.mark.timeout(400)
def test_a_job_running_through_a_redis_restart_completes(tmp_path) -> None:
    # A stack of its own, on a Redis that keeps its data on disk: stopped and started again under a running job, as
    # by an operator or a crash and a supervisor.
    server = EmbeddedRedis(tmp_path / "redis").start()
    settings = Settings(redis_url=server.url, api_port=free_port(), worker_concurrency=4)
    try:
        with running_stack(settings, tmp_path) as base, httpx.Client(base_url=base, timeout=60) as http:
            body = {
                "messages": [{"role": "user", "content": "Count to a hundred."}],
                "max_tokens": 120,
                "ignore_eos": True,
                "background": True,
            }
            job = http.post("/v1/chat/completions", json=body).json()
            wait_for(http, job["id"], lambda j: j["progress"]["completion_tokens"] >= 5)
            port = server.port
            server.stop()
            time.sleep(1)
            server = EmbeddedRedis(tmp_path / "redis")
            server.port = port  # the same port, though the old one's connections may still hold it in TIME_WAIT
            server.start()
            done = wait_for(http, job["id"], lambda j: j["status"] != "in_progress", timeout=300)
            assert done["status"] == "completed" and done["usage"]["completion_tokens"] == 120
            # Its whole log, once each and in order: nothing written while Redis was away was lost.
            frames = stream(http, "GET", f"/v1/chat/completions/{job['id']}", params={"stream": "true"})
            assert [f.id for f in frames] == list(range(1, len(frames) + 1)) and frames[-1].data == "[DONE]"
            assert all("error" not in f.json for f in frames[:-1])
            # The worker is still there: it takes new jobs.
            again = http.post("/v1/chat/completions", json={**body, "max_tokens": 3, "background": False})
            assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()
