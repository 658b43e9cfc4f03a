"""docker-compose.yml cannot run here (no Docker engine), so check that it describes the stack the CLI starts."""

from __future__ import annotations

from pathlib import Path

import yaml

from chatq.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_compose_runs_redis_worker_api_and_flower():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "worker", "api", "flower"}
    assert "noeviction" in services["redis"]["command"] and "--appendonly" in services["redis"]["command"]
    for name in ("worker", "api", "flower"):
        command = services[name]["command"]
        assert command[:2] == ["chatq", name]
        assert services[name]["environment"]["CHATQ_REDIS_URL"] == "redis://redis:6379/0"
    assert services["api"]["ports"] == ["8000:8000"] and services["flower"]["ports"] == ["127.0.0.1:5555:5555"]
    assert all(s["restart"] == "unless-stopped" for s in services.values())  # a crash or a reboot brings it back
    # Healthy once it answers by itself: the API's /health also wants a worker, which a GPU worker is not while
    # it loads, and redis-cli exits 0 on an error reply.
    assert "/version" in " ".join(services["api"]["healthcheck"]["test"])
    assert "PONG" in " ".join(services["redis"]["healthcheck"]["test"])
    assert services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # Docker's SIGKILL comes after the worker's grace period, by when its running jobs were finished or handed over.
    worker = services["worker"]
    assert int(worker["stop_grace_period"].removesuffix("s")) > float(worker["environment"]["CHATQ_STOP_GRACE"]) + 5


def test_cli_knows_every_command_compose_uses(capsys):
    for name in ("worker", "api", "flower"):
        try:
            main([name, "--help"])
        except SystemExit as e:
            assert e.code == 0
