"""/health says which part is missing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from chatq.api.app import create_app
from chatq.embedded_redis import EmbeddedRedis, free_port


@pytest.fixture(scope="module")
def empty(tmp_path_factory) -> Iterator[str]:
    """A Redis no worker registered in."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("empty-redis"), persist=False).start()
    yield server.url
    server.stop()


def test_health_is_503_without_a_live_worker(settings, empty):
    with TestClient(create_app(settings.model_copy(update={"redis_url": empty}))) as c:
        resp = c.get("/health")
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "no live worker for any model"


def test_health_is_503_without_redis(settings):
    app = create_app(settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"}))
    with TestClient(app) as c:
        resp = c.get("/health")
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "Redis is unreachable"


def test_uptime_checks_may_send_head(http, settings, empty):
    for path in ("/health", "/"):
        got, head = http.get(path), http.head(path)
        assert (head.status_code, head.content) == (200, b"") and got.status_code == 200
        assert head.headers["content-type"] == got.headers["content-type"]
    with TestClient(create_app(settings.model_copy(update={"redis_url": empty}))) as c:
        assert c.head("/health").status_code == 503
