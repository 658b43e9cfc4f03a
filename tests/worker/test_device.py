"""A worker whose GPU is lost in the middle of a job: its jobs continue on another worker with no gap or repeat, and
it exits with its own status for its supervisor to restart it. The loss is planted in a real worker process
(tests/worker/lose_device.py): a CPU cannot make CUDA's sticky errors."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
import torch

from chatq.cli import api_command, worker_command
from chatq.core import keys
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from chatq.worker import device
from chatq.worker.celery_app import EXIT_DEVICE_LOST
from tests.helpers import ROOT, Cluster, frames

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


def test_a_cpu_is_never_lost():
    assert not device.lost(torch.device("cpu"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("device-redis"), persist=False).start()
    settings = Settings(redis_url=server.url, api_port=free_port(), worker_ttl=3, max_attempts=3, result_ttl=30)
    c = Cluster(settings, tmp_path_factory.mktemp("device-logs"))
    try:
        c.start("api", api_command(settings))
        yield c
    finally:
        c.stop_all()
        server.stop()


def start_losing_worker(cluster: Cluster, after: int) -> str:
    """A worker whose forward pass number `after` + 1 loses the device."""
    command = worker_command(cluster.settings)
    args = command[command.index("-A") :]  # the celery program's arguments
    args[args.index("-n") + 1] = "lost@test"
    script = ROOT / "tests" / "worker" / "lose_device.py"
    cluster.start("lost", [sys.executable, str(script), *args], {"LOSE_DEVICE_AFTER": str(after)})
    cluster.models["lost"] = cluster.settings.model_name
    cluster.wait_live("lost")
    return "lost"


def test_a_worker_that_loses_its_gpu_hands_its_jobs_on_and_exits(cluster):
    lost = start_losing_worker(cluster, after=12)
    base = f"http://{cluster.settings.api_host}:{cluster.settings.api_port}"
    request = {"messages": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    got, other = [], ""
    with httpx.Client(base_url=base, timeout=httpx.Timeout(180, read=150)) as http:
        with http.stream("POST", "/v1/chat/completions", json=request) as resp:
            assert resp.status_code == 200, resp.read()
            for frame in frames(resp.iter_lines()):
                got.append(frame)
                if len(got) == 1:
                    assert cluster.holder(got[0].json["id"]) == lost
                    other = cluster.start_worker()  # idle until the job comes back to the queue
        job_id = got[0].json["id"]
        assert cluster.procs[lost].wait(timeout=60) == EXIT_DEVICE_LOST
        uninterrupted = http.post("/v1/chat/completions", json=request | {"stream": False}).json()
    assert [f.id for f in got] == list(range(1, len(got) + 1)) and got[-1].data == "[DONE]"
    text = "".join(c["delta"].get("content") or "" for f in got[:-1] for c in f.json.get("choices", []))
    assert text == uninterrupted["choices"][0]["message"]["content"]
    record = cluster.r.hgetall(keys.job(job_id))
    assert record["status"] == "completed" and record["attempts"] == "2"
    assert record["worker"].split("@")[0] == other
    live = cluster.live_workers()
    assert lost not in live and other in live
    assert "was lost" in cluster.tail(lost)
