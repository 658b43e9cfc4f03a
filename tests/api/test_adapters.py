"""LoRA adapters on the real stack: one named at the worker's start (CHATQ_LORA_MODULES), others loaded and unloaded
through vLLM's routes, each selected by `model` in chat, completions, the Responses API and background jobs, and
answering as transformers + peft does on the same weights."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from chatq.core import keys
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.render import Renderer
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import assert_error, build_tiny_model, make_adapter, peft_greedy, running_api, running_stack

OPERATOR, ADMIN = "operator-key-0123456789", "admin-key-0123456789"
QUESTION = "Name three colours of the rainbow."
NEW = 16


@dataclass
class Stack:
    base: str
    r: redis.Redis
    root: Path  # where the tests' adapters are made
    http: httpx.Client  # with the operator's key
    settings: Settings
    env: dict[str, str]

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=OPERATOR, max_retries=0, timeout=120)

    def load(self, name: str, path: Path | str, **extra: object) -> httpx.Response:
        return self.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})

    def until_listed(self, name: str, listed: bool = True) -> None:
        deadline = time.time() + 10
        while (name in [m.id for m in self.openai().models.list()]) != listed:
            assert time.time() < deadline, f"{name} not {'listed' if listed else 'gone'} in 10 s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(root / "static", rank=8, seed=1)
    server = EmbeddedRedis(tmp_path_factory.mktemp("adapters-redis"), persist=False).start()
    settings = Settings(redis_url=server.url, api_port=free_port(), api_keys=OPERATOR, admin_key=ADMIN)
    env = {
        "CHATQ_ALLOW_RUNTIME_LORA_UPDATING": "true",
        "CHATQ_LORA_MODULES": f"static={root / 'static'}",
        "CHATQ_FILES_DIR": str(tmp_path_factory.mktemp("adapters-files")),
    }
    try:
        with running_stack(settings, tmp_path_factory.mktemp("adapters-logs"), env) as base:
            headers = {"Authorization": f"Bearer {OPERATOR}"}
            with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
                r = redis.Redis.from_url(server.url, decode_responses=True)
                yield Stack(base, r, root, http, settings, env)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prompt(renderer: Renderer) -> list[int]:
    return renderer.render(ChatCompletionRequest(messages=[{"role": "user", "content": QUESTION}])).ids


def greedy_ids(client: openai.OpenAI, model: str) -> list[int]:
    done = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert done.model == model
    return done.choices[0].model_extra["token_ids"]  # type: ignore[index]


def test_adapters_answer_as_peft_does_side_by_side_with_the_model(served, prompt, model_name):
    runtime = make_adapter(served.root / "runtime", rank=16, seed=2)
    assert served.load("runtime", runtime).text == "Success: LoRA adapter 'runtime' added successfully."
    served.until_listed("runtime")
    client = served.openai()
    names = [model_name, "static", "runtime"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # twice each, at once: one worker's batch mixes them
        got = list(pool.map(lambda name: greedy_ids(client, name), names * 2))
    paths = {model_name: None, "static": served.root / "static", "runtime": runtime}
    want = {name: peft_greedy(paths[name], [prompt], NEW)[0] for name in names}
    assert got == [want[name] for name in names * 2]
    assert len({tuple(ids) for ids in want.values()}) == 3, "each adapter changes the answer"


def test_the_models_list_shows_each_adapter_with_its_parent_and_files(served, model_name):
    cards = {m["id"]: m for m in served.http.get("/v1/models").json()["data"]}
    assert cards["static"]["parent"] == model_name and cards["static"]["root"] == str(served.root / "static")
    assert cards[model_name]["parent"] is None
    assert served.http.get("/v1/models/static").json()["root"] == str(served.root / "static")


def test_every_route_and_background_jobs_take_an_adapter_as_model(served):
    client = served.openai()
    text = client.completions.create(model="static", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert text.model == "static" and text.choices[0].text
    response = client.responses.create(model="static", input=QUESTION, max_output_tokens=8, background=True)
    while response.status in ("queued", "in_progress"):
        time.sleep(0.2)
        response = client.responses.retrieve(response.id)
    assert response.status == "incomplete" and response.model == "static" and response.output_text
    job = served.http.post(
        "/v1/chat/completions",
        json={
            "model": "static",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 5,
            "background": True,
        },
    ).json()
    while job["status"] in ("queued", "in_progress"):
        time.sleep(0.2)
        job = served.http.get(f"/v1/chat/completions/{job['id']}").json()
    assert job["status"] == "completed" and job["model"] == "static"


def test_an_adapters_prefix_cache_is_its_own(served, model_name):
    client = served.openai()
    question = [{"role": "user", "content": "Describe, in a few careful sentences, how rain forms over the sea."}]

    def cached(model: str) -> int:
        done = client.chat.completions.create(model=model, messages=question, max_tokens=2, temperature=0)
        return done.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]

    assert served.load("unused", make_adapter(served.root / "unused", rank=4, seed=6)).status_code == 200
    served.until_listed("unused")
    cached(model_name)
    assert cached(model_name) > 0, "the model's second request hits its cache"
    assert cached("unused") == 0, "nothing the model cached serves the adapter"
    assert cached("unused") > 0, "the adapter's second request hits its own cache"


def test_unloading_makes_the_name_unknown_everywhere(served):
    assert served.load("brief", make_adapter(served.root / "brief", rank=4, seed=3)).status_code == 200
    served.until_listed("brief")
    gone = served.http.post("/v1/unload_lora_adapter", json={"lora_name": "brief"})
    assert gone.text == "Success: LoRA adapter 'brief' removed successfully."
    served.until_listed("brief", listed=False)
    asked = served.http.post(
        "/v1/chat/completions", json={"model": "brief", "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert assert_error(asked, 404, "NotFoundError", "model")["message"] == "The model `brief` does not exist."
    again = served.http.post("/v1/unload_lora_adapter", json={"lora_name": "brief"})
    assert assert_error(again, 404, "NotFoundError", "lora_name")["message"] == (
        "The lora adapter 'brief' cannot be found."
    )


def test_bad_loads_are_400s_that_change_nothing(served, model_name, tmp_path):
    before = served.r.hgetall(keys.adapters())
    tiny = build_tiny_model(tmp_path / "tiny")
    cases = {
        "another model's": (make_adapter(tmp_path / "other", rank=8, base=tiny), "is not one of"),
        "too high a rank": (make_adapter(tmp_path / "wide", rank=32), "rank 32 is above the workers'"),
        "missing": (tmp_path / "nowhere", "cannot be read"),
        "a base model's name": (served.root / "static", "conflicts with a served base model"),
        "a name in use": (served.root / "static", "has already been loaded"),
    }
    names = {"a base model's name": model_name, "a name in use": "static"}
    for case, (path, why) in cases.items():
        body = assert_error(
            served.load(names.get(case, "bad"), path),
            400,
            "BadRequestError",
            "lora_name" if case in names else "lora_path",
        )
        assert why in body["message"], case
    assert served.r.hgetall(keys.adapters()) == before


def test_a_managed_key_may_not_load_adapters(served):
    made = httpx.post(
        f"{served.base}/v1/admin/keys", json={"name": "tenant"}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    secret = made.json()["value"]
    refused = httpx.post(
        f"{served.base}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": str(served.root / "static")},
        headers={"Authorization": f"Bearer {secret}"},
    )
    assert_error(refused, 403, "PermissionDeniedError", None)
    by_admin = httpx.post(
        f"{served.base}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert by_admin.status_code == 404, "the admin key may: there is no such adapter"


def test_an_adapter_a_worker_cannot_read_fails_its_jobs_alone(served, model_name):
    path = make_adapter(served.root / "vanishing", rank=8, seed=4)
    assert served.load("vanishing", path).status_code == 200
    served.until_listed("vanishing")
    shutil.rmtree(path)
    failed = served.http.post(
        "/v1/chat/completions", json={"model": "vanishing", "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert failed.status_code == 400 and "cannot be loaded" in failed.json()["error"]["message"]
    fine = served.openai().chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert fine.choices[0].message.content


def test_the_routes_are_not_served_unless_allowed(http):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}).status_code == 404


def test_a_batch_runs_its_lines_under_the_adapter_they_name(served):
    client = served.openai()
    body = {"model": "static", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 0}
    line = {"custom_id": "only", "method": "POST", "url": "/v1/chat/completions", "body": body}
    uploaded = client.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.time() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.time() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id, batch
    [out] = [json.loads(text) for text in client.files.content(batch.output_file_id).text.splitlines()]
    assert out["response"]["status_code"] == 200 and out["response"]["body"]["model"] == "static"


def test_another_api_knows_the_adapters_the_first_loaded(served, tmp_path):
    assert served.load("shared", make_adapter(served.root / "shared", rank=4, seed=7)).status_code == 200
    other = served.settings.model_copy(update={"api_port": free_port()})
    with running_api(other, tmp_path, served.env) as base:
        deadline = time.time() + 10
        while True:
            listed = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {OPERATOR}"}).json()["data"]
            if {"static", "shared"} <= {m["id"] for m in listed}:
                break
            assert time.time() < deadline, listed
            time.sleep(0.2)
