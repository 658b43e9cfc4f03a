"""/health says which part is missing."""

from __future__ import annotations

from fastapi.testclient import TestClient

from chatq.api.app import create_app
from chatq.embedded_redis import EmbeddedRedis, free_port


def test_health_is_503_without_a_live_worker(settings, tmp_path):
    empty = EmbeddedRedis(tmp_path, persist=False).start()
    try:
        with TestClient(create_app(settings.model_copy(update={"redis_url": empty.url}))) as c:
            resp = c.get("/health")
    finally:
        empty.stop()
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "no live worker for any model"


def test_health_is_503_without_redis(settings):
    app = create_app(settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"}))
    with TestClient(app) as c:
        resp = c.get("/health")
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "Redis is unreachable"


def test_uptime_checks_may_send_head(http, settings, tmp_path):
    for path in ("/health", "/"):
        got, head = http.get(path), http.head(path)
        assert (head.status_code, head.content) == (200, b"") and got.status_code == 200
        assert head.headers["content-type"] == got.headers["content-type"]
    empty = EmbeddedRedis(tmp_path, persist=False).start()
    try:
        with TestClient(create_app(settings.model_copy(update={"redis_url": empty.url}))) as c:
            assert c.head("/health").status_code == 503
    finally:
        empty.stop()
