"""Managed API keys through the admin routes and `chatq keys`: a key created at run time serves at once, on every
API; a revoked or expired one is refused by every API within a second; the admin key alone manages them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from chatq.core.api_keys import SECRET_PREFIX
from chatq.embedded_redis import free_port
from tests.api.conftest import ADMIN, KEY_A, Guarded
from tests.helpers import ROOT, assert_error, running_api

M = [{"role": "user", "content": "hi"}]


def admin(g: Guarded, key: str | None = ADMIN) -> httpx.Client:
    return g.client(key)


def create(g: Guarded, **fields) -> dict:
    name = fields.pop("name", None) or f"k-{uuid.uuid4().hex[:8]}"
    r = admin(g).post("/v1/admin/keys", json={"name": name, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def sdk(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_a_key_created_at_run_time_serves_at_once_and_owns_what_it_creates(guarded):
    model = guarded.settings.model_name
    made = create(guarded, rpm=60, tpm=10_000, models=[model])
    secret = made.pop("value")
    assert secret.startswith(SECRET_PREFIX) and len(secret) > 40
    assert made == {
        "object": "api_key",
        "name": made["name"],
        "redacted_value": f"{secret[: len(SECRET_PREFIX) + 2]}...{secret[-4:]}",
        "created_at": made["created_at"],
        "expires_at": None,
        "rpm": 60,
        "tpm": 10_000,
        "in_flight": None,
        "batch_tokens": None,
        "weight": 1.0,
        "models": [model],
    }
    answer = sdk(guarded.base, secret).chat.completions.create(
        model=model, messages=M, max_tokens=2, extra_body={"background": True}
    )
    assert sdk(guarded.base, secret).chat.completions.retrieve(answer.id).id == answer.id
    with pytest.raises(openai.NotFoundError):  # another key's job is no job of theirs
        sdk(guarded.base, KEY_A).chat.completions.retrieve(answer.id)
    listed = admin(guarded).get("/v1/admin/keys").json()
    assert made in listed["data"] and all("value" not in k for k in listed["data"])
    assert admin(guarded).get(f"/v1/admin/keys/{made['name']}").json() == made
    # Redis holds its hash, never the key; nor does the API's log show it.
    dump = "".join(
        str(guarded.r.get(k) or "") for k in guarded.r.scan_iter("chatq:apikey*") if guarded.r.type(k) == "string"
    )
    assert dump and secret not in dump
    assert secret not in (guarded.logs / "api.log").read_text()


def test_a_key_sees_only_the_models_it_may_use(guarded):
    model = guarded.settings.model_name
    client = sdk(guarded.base, create(guarded, models=["another-model"])["value"])
    assert client.models.list().data == []
    for call in (
        lambda: client.chat.completions.create(model=model, messages=M, max_tokens=2),
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=2),
        lambda: client.responses.create(model=model, input="hi", max_output_tokens=2),
        lambda: client.models.retrieve(model),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.status_code == 404 and f"`{model}` does not exist" in str(refused.value)
    allowed = sdk(guarded.base, create(guarded, models=[model])["value"])
    assert [m.id for m in allowed.models.list().data] == [model]


def test_only_the_admin_key_manages_keys(guarded):
    made = create(guarded)
    for key in (None, KEY_A, made["value"], ADMIN + "x"):
        for method, path in (
            ("GET", "/v1/admin/keys"),
            ("POST", "/v1/admin/keys"),
            ("DELETE", f"/v1/admin/keys/{made['name']}"),
        ):
            r = admin(guarded, key).request(method, path, json={"name": "intruder"} if method == "POST" else None)
            assert_error(r, 401, "AuthenticationError", None)
    assert admin(guarded).get(f"/v1/admin/keys/{made['name']}").status_code == 200
    assert admin(guarded).get("/v1/admin/keys/intruder").status_code == 404
    with pytest.raises(openai.AuthenticationError):  # nor is the admin key an API key
        sdk(guarded.base, ADMIN).models.list()


def test_bad_input_is_refused_and_changes_nothing(guarded):
    made = create(guarded)
    before = admin(guarded).get("/v1/admin/keys").json()
    http = admin(guarded)
    assert_error(http.post("/v1/admin/keys", json={"name": made["name"]}), 409, "ConflictError", "name")
    assert_error(http.post("/v1/admin/keys", json={"name": "bad name!"}), 400, "BadRequestError", "name")
    assert_error(http.post("/v1/admin/keys", json={"name": "x1", "rpm": 0}), 400, "BadRequestError", "rpm")
    assert_error(http.post("/v1/admin/keys", json={"name": "x2", "tpm": -1}), 400, "BadRequestError", "tpm")
    assert_error(http.post("/v1/admin/keys", json={"name": "x3", "colour": 1}), 400, "BadRequestError", "colour")
    past = {"name": "x4", "expires_at": int(time.time()) - 5}
    assert_error(http.post("/v1/admin/keys", json=past), 400, "BadRequestError", "expires_at")
    assert_error(http.post("/v1/admin/keys/nobody", json={"rpm": 5}), 404, "NotFoundError", "name")
    assert_error(http.delete("/v1/admin/keys/nobody"), 404, "NotFoundError", "name")
    assert_error(http.post(f"/v1/admin/keys/{made['name']}", json={"tpm": -3}), 400, "BadRequestError", "tpm")
    assert http.get("/v1/admin/keys").json() == before


def test_an_update_changes_only_the_fields_it_sets(guarded):
    made = create(guarded, rpm=10, tpm=1000, expires_at=int(time.time()) + 3600)
    http = admin(guarded)
    updated = http.post(f"/v1/admin/keys/{made['name']}", json={"tpm": None, "models": ["m"]}).json()
    assert (updated["rpm"], updated["tpm"], updated["models"]) == (10, None, ["m"])
    assert updated["expires_at"] == made["expires_at"] and updated["redacted_value"] == made["redacted_value"]
    assert http.get(f"/v1/admin/keys/{made['name']}").json() == updated


def test_a_revoked_key_is_refused_by_every_api_within_a_second(guarded, tmp_path):
    other = guarded.settings.model_copy(update={"api_port": free_port()})
    made = create(guarded)
    secret = made["value"]
    with running_api(other, tmp_path) as second:
        for base in (guarded.base, second):  # each API has just read the key
            assert len(sdk(base, secret).models.list().data) >= 0
        r = admin(guarded).delete(f"/v1/admin/keys/{made['name']}")
        assert r.json() == {"object": "api_key.deleted", "name": made["name"], "deleted": True}
        revoked = time.monotonic()
        time.sleep(1.05)
        for base in (guarded.base, second):
            with pytest.raises(openai.AuthenticationError):
                sdk(base, secret).models.list()
        assert time.monotonic() - revoked < 3
    assert admin(guarded).get(f"/v1/admin/keys/{made['name']}").status_code == 404
    assert KEY_A and sdk(guarded.base, KEY_A).models.list()  # the others serve on


def test_a_key_past_its_expiry_is_refused(guarded):
    made = create(guarded, expires_at=int(time.time()) + 2)
    sdk(guarded.base, made["value"]).models.list()
    time.sleep(max(0.0, made["expires_at"] - time.time()) + 0.1)
    with pytest.raises(openai.AuthenticationError):
        sdk(guarded.base, made["value"]).models.list()


def test_chatq_keys_creates_lists_updates_and_revokes(guarded):
    env = os.environ | {"CHATQ_API_URL": guarded.base, "CHATQ_ADMIN_KEY": ADMIN}

    def chatq(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "chatq.cli", "keys", *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    name = f"cli-{uuid.uuid4().hex[:6]}"
    made = chatq("create", name, "--rpm", "30", "--tpm", "5000", "--models", "a,b")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)
    assert (key["name"], key["rpm"], key["tpm"], key["models"]) == (name, 30, 5000, ["a", "b"])
    assert "shown once" in made.stderr
    sdk(guarded.base, key["value"]).models.list()
    assert name in {k["name"] for k in json.loads(chatq("list").stdout)["data"]}
    updated = json.loads(chatq("update", name, "--rpm", "0", "--tpm", "7000", "--in-flight", "2").stdout)
    assert (updated["rpm"], updated["tpm"], updated["in_flight"], updated["models"]) == (None, 7000, 2, ["a", "b"])
    assert chatq("revoke", name).returncode == 0
    assert chatq("show", name).returncode == 1
    refused = subprocess.run(
        [sys.executable, "-m", "chatq.cli", "keys", "list"],
        env=env | {"CHATQ_ADMIN_KEY": "wrong"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "admin key" in refused.stdout


def test_usage_is_counted_per_key_by_day_and_model(guarded):
    model = guarded.settings.model_name
    made = create(guarded)
    client = sdk(guarded.base, made["value"])
    answers = [client.chat.completions.create(model=model, messages=M, max_tokens=3) for _ in range(2)]
    expected = {
        "model": model,
        "requests": 2,
        "input_tokens": sum(a.usage.prompt_tokens for a in answers),
        "output_tokens": sum(a.usage.completion_tokens for a in answers),
    }

    def summed(rows: list[dict]) -> dict:  # two days asked for: the test may cross midnight (UTC)
        assert {r["model"] for r in rows} <= {model}
        return {"model": model} | {m: sum(r[m] for r in rows) for m in ("requests", "input_tokens", "output_tokens")}

    deadline = time.monotonic() + 5
    while (
        summed(admin(guarded).get(f"/v1/admin/keys/{made['name']}/usage", params={"days": 2}).json()["data"])
        != expected
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    own = guarded.client(made["value"]).get("/v1/usage", params={"days": 2}).json()["data"]
    assert summed(own) == expected and own[-1]["date"] == time.strftime("%Y-%m-%d", time.gmtime())
    assert guarded.client(KEY_A).get("/v1/usage").json()["data"] != own  # each key reads its own
    assert (
        guarded.client(made["value"]).get("/v1/usage").json()["key"]
        == admin(guarded).get(f"/v1/admin/keys/{made['name']}").json()
    )
    assert guarded.client(KEY_A).get("/v1/usage").json()["key"] is None  # a fixed key has no name nor limits
    # /metrics counts it by its name (a managed key's; fixed keys have none).
    scraped = httpx.get(f"{guarded.base}/metrics").text
    labels = f'api_key="{made["name"]}",model_name="{model}"'
    assert f"chatq:api_key_requests_total{{{labels}}} 2.0" in scraped
    assert f"chatq:api_key_output_tokens_total{{{labels}}} {float(expected['output_tokens'])}" in scraped
    assert made["value"] not in scraped and KEY_A not in scraped
    bad = guarded.client(made["value"]).get("/v1/usage", params={"days": 0})
    assert_error(bad, 400, "BadRequestError", "days")
