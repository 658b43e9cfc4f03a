"""API keys: without the right one every route but /health and /version is a 401, and a job is seen, streamed,
cancelled and deleted only with the key that created it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import uuid

import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from chatq.api.app import create_app
from chatq.core import keys
from chatq.core.job import cache_partition
from chatq.core.settings import Settings
from tests.api.conftest import KEY_A, KEY_B, Guarded
from tests.helpers import assert_error, wait_for

M = [{"role": "user", "content": "hi"}]
GUARDED = [
    ("POST", "/v1/chat/completions", {"messages": M, "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/chat/completions", None),
    ("GET", "/v1/chat/completions/chatcmpl-x", None),
    ("POST", "/v1/chat/completions/chatcmpl-x/cancel", None),
    ("DELETE", "/v1/chat/completions/chatcmpl-x", None),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("GET", "/v1/responses/resp_x", None),
    ("GET", "/v1/responses/resp_x/input_items", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]
BAD_HEADERS = [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": f"Basic {KEY_A}"},
    {"Authorization": "Bearer"},
    {"Authorization": KEY_A},
    {"Authorization": f"Bearer {KEY_A}x"},
]


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
def test_a_missing_or_wrong_key_is_a_401(guarded: Guarded, method: str, path: str, body: dict | None):
    before = set(guarded.r.scan_iter())
    with guarded.client(None) as http:
        for headers in BAD_HEADERS:
            resp = http.request(method, path, json=body, headers=headers)
            error = assert_error(resp, 401, "AuthenticationError", None)
            assert KEY_A not in error["message"] and resp.headers["www-authenticate"] == "Bearer"
        if method == "POST":  # the key is checked before the body is: a body that is not JSON is a 401 too
            resp = http.request(method, path, content=b"{not json", headers={"Content-Type": "application/json"})
            assert_error(resp, 401, "AuthenticationError", None)
    assert set(guarded.r.scan_iter()) <= before  # nothing was created (an earlier test's keys may expire meanwhile)


def test_health_and_version_need_no_key(guarded: Guarded):
    with guarded.client(None) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").status_code == 200


def test_either_configured_key_is_let_in(guarded: Guarded):
    for key in (KEY_A, KEY_B):
        sdk = openai.OpenAI(base_url=f"{guarded.base}/v1", api_key=key, max_retries=0, timeout=120)
        assert [m.id for m in sdk.models.list().data] == [guarded.settings.model_name]
    sdk = openai.OpenAI(base_url=f"{guarded.base}/v1", api_key="nope", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_a_job_is_visible_only_to_the_key_that_created_it(guarded: Guarded):
    with guarded.client(KEY_A) as a, guarded.client(KEY_B) as b:
        resp = a.post("/v1/chat/completions", json={"messages": M, "max_tokens": 3, "background": True})
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["id"]
        record = guarded.r.hgetall(keys.job(job_id))
        # The owner is the key's hash; the key itself is nowhere in the record.
        assert record["owner"] == hashlib.sha256(KEY_A.encode()).hexdigest()
        assert not any(KEY_A in v for v in record.values())

        missing = "chatcmpl-no-such-job"
        for method, suffix, params in (
            ("GET", "", {}),
            ("GET", "", {"stream": "true"}),
            ("POST", "/cancel", {}),
            ("DELETE", "", {}),
        ):
            theirs = b.request(method, f"/v1/chat/completions/{job_id}{suffix}", params=params)
            nobodys = b.request(method, f"/v1/chat/completions/{missing}{suffix}", params=params)
            assert theirs.status_code == nobodys.status_code == 404
            assert theirs.json() == _with_id(nobodys.json(), missing, job_id)

        # Untouched by B's cancel and delete: A still sees it run to its end.
        done = wait_for(a, job_id, lambda j: j["status"] != "queued" and j["status"] != "in_progress")
        assert done["status"] == "completed"
        assert a.delete(f"/v1/chat/completions/{job_id}").json()["deleted"] is True


def _with_id(body: dict, old: str, new: str) -> dict:
    body["error"]["message"] = body["error"]["message"].replace(old, new)
    return body


def test_an_open_api_warns_once_at_start(settings: Settings, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="chatq.api.auth")
    with TestClient(create_app(settings)) as http:
        assert http.get("/version").status_code == 200
    warnings = [r for r in caplog.records if "open to anyone" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING]


def test_a_keyed_api_does_not_warn(settings: Settings, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="chatq.api.auth")
    keyed = settings.model_copy(update={"api_keys": SecretStr(KEY_A)})
    with TestClient(create_app(keyed)) as http:
        assert http.get("/v1/models").status_code == 401
        headers = {"Authorization": f"Bearer {KEY_A}"}
        assert http.get("/v1/models", headers=headers).status_code in (200, 503)  # 503: model files not read yet
    assert not [r for r in caplog.records if "open to anyone" in r.getMessage()]


def test_the_command_sends_its_key(guarded: Guarded):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATQ_")} | {"CHATQ_API_URL": guarded.base}
    command = [sys.executable, "-m", "chatq.cli", "job", "get", "chatcmpl-no-such-job"]
    for key, error_type in ((None, "AuthenticationError"), (KEY_B, "NotFoundError")):
        run = subprocess.run(command, env=env | ({"CHATQ_API_KEY": key} if key else {}), capture_output=True, text=True)
        assert run.returncode == 1 and json.loads(run.stdout)["error"]["type"] == error_type, run.stderr


def test_only_the_configured_origins_may_call_from_a_browser(settings: Settings):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization, content-type"
    with TestClient(create_app(settings)) as http:
        closed = http.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in closed.headers
    allowed = settings.model_copy(update={"cors_origins": "https://app.example, https://other.example"})
    with TestClient(create_app(allowed)) as http:
        opened = http.options("/v1/chat/completions", headers=preflight)
        assert opened.status_code == 200 and opened.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in opened.headers["access-control-allow-headers"].lower()
        foreign = http.options("/v1/chat/completions", headers=preflight | {"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in foreign.headers
        listed = http.get("/version", headers={"Origin": "https://other.example"})
        assert listed.headers["access-control-allow-origin"] == "https://other.example"


def test_the_prefix_cache_is_partitioned_by_key_and_within_a_key_by_cache_salt(guarded: Guarded):
    system = {"role": "system", "content": f"{uuid.uuid4().hex} " + "You answer questions about tides. " * 12}

    def cached(http, question: str, **fields) -> int:
        body = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 1, **fields}
        return http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with guarded.client(KEY_A) as a, guarded.client(KEY_B) as b:
        assert cached(a, "When is high tide?") == 0
        assert cached(a, "Why are there tides?") >= 96  # the key's own system prompt, cached
        assert cached(b, "What is a neap tide?") == 0  # another key's is not found
        assert cached(a, "What is a spring tide?", cache_salt="team-1") == 0
        assert cached(a, "What is a king tide?", cache_salt="team-1") >= 96
        assert cached(b, "What is a red tide?", cache_salt="team-1") == 0  # a salt partitions within its key only


def test_a_jobs_partition_is_its_keys_and_salts_unless_the_cache_is_shared():
    a, b = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    partitions = {cache_partition(owner, salt, False) for owner in (a, b) for salt in (None, "s")}
    assert len(partitions) == 4 and "" not in partitions
    assert cache_partition("", None, False) == "" == cache_partition(a, None, True)  # an open API, a shared cache
    assert cache_partition(a, "s", True) == cache_partition(b, "s", True) != ""
