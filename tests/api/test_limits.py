"""A managed key's requests and tokens per minute, as the openai SDK meets them: OpenAI's headers on every answer, its
429 body, a wait the SDK honours, and a request too large for the limit refused for good."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.api.conftest import ADMIN, Guarded

M = [{"role": "user", "content": "hi"}]


def managed(g: Guarded, **limits) -> str:
    r = g.client(ADMIN).post("/v1/admin/keys", json={"name": f"lim-{uuid.uuid4().hex[:8]}", **limits})
    assert r.status_code == 200, r.text
    return r.json()["value"]


def statuses_of(key: str, base: str, seen: list[int]) -> openai.OpenAI:
    """The SDK as users make it (two retries), each HTTP answer's status recorded in `seen`."""
    http = httpx.Client(event_hooks={"response": [lambda r: seen.append(r.status_code)]}, timeout=120)
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, http_client=http)


def test_every_answer_says_what_is_left_and_the_first_past_the_limit_is_refused(guarded):
    key = managed(guarded, rpm=3, tpm=100_000)
    http = guarded.client(key)
    body = {"messages": M, "max_tokens": 2}
    lefts = []
    for extra in ({}, {"stream": True}, {"background": True}):
        r = http.post("/v1/chat/completions", json=body | extra)
        assert r.status_code in (200, 202), r.text
        assert r.headers["x-ratelimit-limit-requests"] == "3" and r.headers["x-ratelimit-limit-tokens"] == "100000"
        lefts.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < 100_000
    assert lefts == [2, 1, 0]
    refused = http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("requests", None, "rate_limit_exceeded")
    assert error["message"].startswith(
        f"Rate limit reached for {guarded.settings.model_name} on requests per min (RPM)"
    )
    assert "Limit 3, Used 3, Requested 1. Please try again in" in error["message"]
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 0 < wait_ms <= 20_000 and int(refused.headers["retry-after"]) == -(-wait_ms // 1000)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # The Responses API and legacy completions count against the same minute.
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 429
    assert http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}).status_code == 429


def test_the_sdk_waits_as_told_and_its_retry_is_served(guarded):
    key = managed(guarded, tpm=120)  # two tokens a second
    first = guarded.client(key).post("/v1/chat/completions", json={"messages": M, "max_tokens": 4, "ignore_eos": True})
    left, prompt = int(first.headers["x-ratelimit-remaining-tokens"]), first.json()["usage"]["prompt_tokens"]
    seen: list[int] = []
    client = statuses_of(key, guarded.base, seen)
    start = time.monotonic()
    answer = client.chat.completions.create(
        model=guarded.settings.model_name, messages=M, max_tokens=left - prompt + 4, extra_body={"ignore_eos": True}
    )
    assert seen[0] == 429 and seen[-1] == 200 and answer.choices[0].message.content
    assert time.monotonic() - start >= 1  # it waited for the tokens it lacked


def test_a_request_larger_than_the_limit_is_refused_for_good(guarded):
    key = managed(guarded, tpm=50)
    seen: list[int] = []
    with pytest.raises(openai.RateLimitError) as refused:
        statuses_of(key, guarded.base, seen).chat.completions.create(
            model=guarded.settings.model_name, messages=M, max_tokens=100
        )
    assert seen == [429]  # no retry: it can never fit
    error = refused.value.body
    assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded"
    assert error["message"].startswith(f"Request too large for {guarded.settings.model_name} on tokens per min (TPM)")
    assert refused.value.response.headers["x-should-retry"] == "false"


def test_tokens_a_job_did_not_use_come_back_when_it_ends(guarded):
    key = managed(guarded, tpm=2000)
    http = guarded.client(key)
    long = http.post("/v1/chat/completions", json={"messages": M, "max_tokens": 1000})
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] < 900
    left_after_long = int(long.headers["x-ratelimit-remaining-tokens"])
    deadline = time.monotonic() + 3  # the bucket itself refills 100 tokens in that time
    while True:  # the give-back follows the job's end
        short = http.post("/v1/chat/completions", json={"messages": M, "max_tokens": 1})
        left = int(short.headers["x-ratelimit-remaining-tokens"])
        if left > left_after_long + 500 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left > left_after_long + 500


def test_a_key_at_its_cap_of_jobs_in_flight_is_refused_until_one_ends(guarded):
    key = managed(guarded, in_flight=1)
    http = guarded.client(key)
    long = {"messages": M, "max_tokens": 400, "ignore_eos": True, "background": True}
    first = http.post("/v1/chat/completions", json=long).json()
    refused = http.post("/v1/chat/completions", json={"messages": M, "max_tokens": 1})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded") and "Limit 1" in error["message"]
    # Another key is not held back by it.
    assert guarded.client().post("/v1/chat/completions", json={"messages": M, "max_tokens": 1}).status_code == 200
    assert http.post(f"/v1/chat/completions/{first['id']}/cancel").json()["status"] == "cancelled"
    assert http.post("/v1/chat/completions", json={"messages": M, "max_tokens": 1}).status_code == 200


def test_keys_without_limits_answer_without_the_headers(guarded):
    for key in (managed(guarded), guarded.settings.api_key_list[0]):
        r = guarded.client(key).post("/v1/chat/completions", json={"messages": M, "max_tokens": 1})
        assert r.status_code == 200 and not [h for h in r.headers if h.startswith("x-ratelimit")]


def batch_of(client: openai.OpenAI, model: str, lines: int, tag: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 64}
    text = "\n".join(
        json.dumps(
            {
                "custom_id": f"{tag}{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body | {"ignore_eos": True},
            }
        )
        for i in range(lines)
    )
    file = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h").id


def settled(client: openai.OpenAI, batch_id: str, *statuses: str) -> Any:
    deadline = time.monotonic() + 300
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


def test_a_keys_batches_hold_no_more_input_tokens_than_its_batch_limit(guarded):
    # Each line's messages are about 15 tokens: four lines fit 100, eight do not.
    client = openai.OpenAI(base_url=f"{guarded.base}/v1", api_key=managed(guarded, batch_tokens=100))
    model = guarded.settings.model_name
    first = batch_of(client, model, 4, "a")
    assert settled(client, first, "in_progress", "completed", "failed").status == "in_progress"
    second = settled(client, batch_of(client, model, 4, "b"), "in_progress", "failed", "completed")
    assert client.batches.retrieve(first).status == "in_progress"  # still holding its tokens
    assert second.status == "failed"
    error = second.errors.data[0]
    assert error.code == "token_limit_exceeded" and "Limit: 100 enqueued tokens" in error.message
    assert settled(client, first, "completed").request_counts.completed == 4  # its end gives the tokens back
    third = settled(client, batch_of(client, model, 4, "c"), "completed", "failed")
    assert third.status == "completed" and third.request_counts.completed == 4
    alone = settled(client, batch_of(client, model, 8, "d"), "in_progress", "failed", "completed")
    assert alone.status == "failed" and alone.errors.data[0].code == "token_limit_exceeded"
