"""Bad requests get OpenAI-shaped errors and change nothing."""

from __future__ import annotations

import httpx
import openai
import pytest
import redis

from shared import keys


def snapshot(r: redis.Redis, model: str) -> tuple[int, int, int]:
    jobs = sum(1 for k in r.scan_iter("chatq:job:*") if k.count(":") == 2)
    return jobs, r.llen(keys.celery_queue(model)), r.zcard(keys.waiting(model))


def assert_error(resp: httpx.Response, status: int, type_: str, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (type_, param, status)
    assert error["message"]
    return error


OK_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "status", "type_", "param"),
    [
        ({"model": "gpt-9", "messages": OK_MESSAGES}, 404, "NotFoundError", "model"),
        ({"model": "gpt-9", "messages": OK_MESSAGES, "stream": True}, 404, "NotFoundError", "model"),
        ({}, 400, "BadRequestError", "messages"),
        ({"messages": []}, 400, "BadRequestError", "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "BadRequestError", "messages.0.role"),
        ({"messages": OK_MESSAGES, "temperature": 3}, 400, "BadRequestError", "temperature"),
        ({"messages": OK_MESSAGES, "max_tokens": 0}, 400, "BadRequestError", "max_tokens"),
        (
            {"messages": OK_MESSAGES, "stream_options": {"include_usage": True}},
            400,
            "BadRequestError",
            "stream_options",
        ),
        ({"messages": OK_MESSAGES, "max_tokens": 10**6}, 400, "BadRequestError", "max_tokens"),
    ],
)
def test_invalid_request_is_refused_and_enqueues_nothing(http, r, model_name, body, status, type_, param):
    before = snapshot(r, model_name)
    assert_error(http.post("/v1/chat/completions", json=body), status, type_, param)
    assert snapshot(r, model_name) == before


def test_malformed_json_is_a_400(http, r, model_name):
    before = snapshot(r, model_name)
    resp = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(resp, 400, "BadRequestError", None)
    assert snapshot(r, model_name) == before


@pytest.mark.parametrize(("method", "suffix"), [("GET", ""), ("POST", "/cancel"), ("DELETE", "")])
def test_unknown_job_id_is_a_404(http, method, suffix):
    resp = http.request(method, f"/v1/chat/completions/chatcmpl-doesnotexist{suffix}")
    assert_error(resp, 404, "NotFoundError", "completion_id")


def test_sdk_raises_typed_errors(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=OK_MESSAGES)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=OK_MESSAGES, top_p=0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve("chatcmpl-missing")


def test_health_names_what_is_up(http):
    body = http.get("/health").json()
    assert body["status"] == "ok" and body["workers"] >= 1
