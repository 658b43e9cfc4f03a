"""Several models on one API: workers started after the API register their model in Redis, and the API serves each
one with no model files of its own, routing every request to its model's queue."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from chatq.api.models import Models
from chatq.cli import api_command
from chatq.core import keys, registry
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import Cluster, assert_error, build_tiny_model, model_info

TINY = "tiny-chat"
DEFAULT = Settings().model_name
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """An API on a Redis of its own, with no worker yet; the tests start them."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("models-redis"), persist=False).start()
    settings = Settings(redis_url=server.url, api_port=free_port())
    c = Cluster(settings, tmp_path_factory.mktemp("models-logs"))
    c.env["CHATQ_WORKER_CONCURRENCY"] = "1"  # one job per worker at a time, so two workers of a model both take some
    try:
        c.start("api", api_command(settings))
        yield c
    finally:
        c.stop_all()
        server.stop()


@pytest.fixture(scope="module")
def http(fleet: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{fleet.settings.api_port}", timeout=120) as client:
        deadline = time.time() + 60
        while True:
            try:
                client.get("/version").raise_for_status()
                break
            except httpx.HTTPError:
                assert time.time() < deadline, fleet.tail("api")
                time.sleep(0.2)
        yield client


def listed(http: httpx.Client) -> dict[str, dict]:
    resp = http.get("/v1/models")
    assert resp.status_code == 200, resp.text
    return {card["id"]: card for card in resp.json()["data"]}


def wait_listed(http: httpx.Client, names: set[str], timeout: float = 180) -> dict[str, dict]:
    deadline = time.time() + timeout
    while set(cards := listed(http)) != names:
        assert time.time() < deadline, f"listed {set(cards)}, not {names}"
        time.sleep(0.2)
    return cards


def chat(http: httpx.Client, model: str, **fields) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": HI, "max_tokens": 6} | fields)


def prompt_text(http: httpx.Client, model: str) -> str:
    resp = http.post("/tokenize", json={"model": model, "messages": HI, "add_generation_prompt": True})
    assert resp.status_code == 200, resp.text
    detok = http.post("/detokenize", json={"model": model, "tokens": resp.json()["tokens"]})
    return detok.json()["prompt"]


def test_an_api_without_workers_serves_no_model(fleet: Cluster, http: httpx.Client):
    assert listed(http) == {}
    assert_error(chat(http, DEFAULT), 404, "NotFoundError", "model")
    assert http.get("/health").status_code == 503


def test_workers_started_after_the_api_are_served_each_with_its_own_template(
    fleet: Cluster, http: httpx.Client, tiny_dir: Path
):
    fleet.wait_live(fleet.start_worker(DEFAULT))
    fleet.wait_live(
        fleet.start_worker(TINY, CHATQ_MODEL=str(tiny_dir)), fleet.start_worker(TINY, CHATQ_MODEL=str(tiny_dir))
    )
    cards = wait_listed(http, {DEFAULT, TINY})
    assert cards[TINY]["max_model_len"] == 2048 and cards[DEFAULT]["max_model_len"] == 8192
    assert all(c["owned_by"] == "chatq" and c["created"] > 0 and c["object"] == "model" for c in cards.values())
    assert http.get(f"/v1/models/{TINY}").json() == cards[TINY]
    assert http.get("/health").json()["models"] == {DEFAULT: 1, TINY: 2}
    # Each model's prompt comes from its own chat template, rendered by the API from what its worker registered.
    assert prompt_text(http, TINY) == "### User:\nSay hi.\n### Assistant:\n"
    assert prompt_text(http, DEFAULT).startswith("<|im_start|>")
    for model in (DEFAULT, TINY):
        resp = chat(http, model)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == model and resp.json()["usage"]["completion_tokens"] > 0


def test_two_workers_of_a_model_share_its_queue(fleet: Cluster, http: httpx.Client):
    ids = [chat(http, TINY, background=True, max_tokens=40, ignore_eos=True).json()["id"] for _ in range(6)]
    holders = set()
    for job_id in ids:
        deadline = time.time() + 120
        while (job := http.get(f"/v1/chat/completions/{job_id}").json())["status"] != "completed":
            assert time.time() < deadline, job
            time.sleep(0.1)
        holders.add(fleet.r.hget(keys.job(job_id), "worker"))
    assert len(holders) == 2, holders  # each worker runs one job at a time: both took some


def test_a_model_without_a_live_worker_is_a_503_but_takes_background_jobs(
    fleet: Cluster, http: httpx.Client, tiny_dir: Path
):
    for name, model in list(fleet.models.items()):
        if model == TINY and fleet.procs[name].poll() is None:
            fleet.signal(name, signal.SIGTERM)
            fleet.procs[name].wait(60)
    assert set(listed(http)) == {DEFAULT}
    resp = chat(http, TINY)
    assert_error(resp, 503, "ServiceUnavailableError", "model")
    assert int(resp.headers["Retry-After"]) >= 1
    queued = chat(http, TINY, background=True)
    assert queued.status_code == 202 and queued.json()["status"] == "queued"
    fleet.wait_live(fleet.start_worker(TINY, CHATQ_MODEL=str(tiny_dir)))
    deadline = time.time() + 120
    while (job := http.get(f"/v1/chat/completions/{queued.json()['id']}").json())["status"] != "completed":
        assert time.time() < deadline, job
        time.sleep(0.1)
    assert job["model"] == TINY


def test_an_unknown_model_is_a_404_everywhere(http: httpx.Client):
    assert_error(chat(http, "no-such-model"), 404, "NotFoundError", "model")
    assert_error(chat(http, "no-such-model", background=True), 404, "NotFoundError", "model")
    resp = http.post("/tokenize", json={"model": "no-such-model", "prompt": "hi"})
    assert_error(resp, 404, "NotFoundError", "model")
    assert_error(http.get("/v1/models/no-such-model"), 404, "NotFoundError", "model")


def test_a_long_unknown_name_is_not_repeated_whole(http: httpx.Client):
    error = assert_error(chat(http, "m" * 100_000), 404, "NotFoundError", "model")
    assert len(error["message"]) < 300 and error["message"].startswith("The model `mmm")


async def test_a_reading_that_outlasts_a_worker_start_does_not_hide_it(tmp_path: Path):
    """A reading of the registry spent loading a new model's tokenizer while a second worker came: the next caller
    who wants a fresh count reads again rather than take the first reading's, which predates that worker."""
    server = EmbeddedRedis(tmp_path, persist=False).start()
    client = aioredis.from_url(server.url, decode_responses=True)
    try:
        fields = registry.entry(model_info())
        registry.register(redis.Redis.from_url(server.url, decode_responses=True), fields)
        await client.zadd(keys.workers(DEFAULT), {"w1@test": time.time()})
        models, loading = Models(client, Settings(redis_url=server.url)), asyncio.Event()

        async def slow_off_loop(fn, *args):
            await loading.wait()
            return fn(*args)

        models.off_loop = slow_off_loop  # type: ignore[method-assign]
        first = asyncio.create_task(models.live())
        await asyncio.sleep(0.3)  # the reading has its replies and is loading the model
        await client.zadd(keys.workers(DEFAULT), {"w2@test": time.time()})
        loading.set()
        assert [(m.name, n) for m, n in await first] == [(DEFAULT, 1)]
        assert [(m.name, n) for m, n in await models.live()] == [(DEFAULT, 2)]
    finally:
        await client.aclose()
        server.stop()
