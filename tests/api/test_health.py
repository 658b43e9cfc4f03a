"""/health says which part is missing."""

from __future__ import annotations

from fastapi.testclient import TestClient

from chatq.api.app import create_app
from chatq.embedded_redis import free_port


def test_health_is_503_without_a_live_worker(settings):
    app = create_app(settings.model_copy(update={"model_name": "model-without-workers"}))
    with TestClient(app) as c:
        resp = c.get("/health")
    assert resp.status_code == 503
    assert "no live worker for model `model-without-workers`" in resp.json()["error"]["message"]


def test_health_is_503_without_redis(settings):
    app = create_app(settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"}))
    with TestClient(app) as c:
        resp = c.get("/health")
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "Redis is unreachable"
