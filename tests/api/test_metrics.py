"""GET /metrics: finished jobs counted once each with their usage, whichever way they ran; HTTP requests by route and
status, errors included; every API replica reporting the same Redis-backed numbers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import redis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from chatq.api.app import create_app
from chatq.core import keys
from chatq.core.settings import Settings
from tests.helpers import frames, quiesce, wait_for

LONG = [{"role": "user", "content": "Count from 1 to 200, one number per line."}]
HISTOGRAMS = (
    "chatq:request_queue_time_seconds",
    "chatq:time_to_first_token_seconds",
    "chatq:inter_token_latency_seconds",
    "chatq:e2e_request_latency_seconds",
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(get: Callable[[str], httpx.Response]) -> Samples:
    """Every sample of /metrics, by name and labels."""
    resp = get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def model_delta(before: Samples, after: Samples, name: str, model: str, **labels: str) -> float:
    return value(after, name, model_name=model, **labels) - value(before, name, model_name=model, **labels)


def http_delta(before: Samples, after: Samples, method: str, route: str, status: int) -> float:
    labels = {"method": method, "route": route, "status": str(status)}
    return value(after, "chatq:http_requests_total", **labels) - value(before, "chatq:http_requests_total", **labels)


def streamed_usage(http: httpx.Client, max_tokens: int) -> tuple[dict, str]:
    body = {"messages": LONG, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(f.data) for f in frames(resp.iter_lines()) if f.data != "[DONE]"]
    reasons = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")]
    return chunks[-1]["usage"], reasons[0]


def test_finished_jobs_add_their_usage_times_and_finish_once_each(
    http: httpx.Client, r: redis.Redis, settings: Settings, model_name: str
):
    quiesce(r, settings)
    before = scrape(http.get)
    streamed, streamed_reason = streamed_usage(http, 9)
    job = http.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": 6, "background": True})
    assert job.status_code == 202
    done = wait_for(http, job.json()["id"], lambda j: j["status"] == "completed")
    refused = http.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": -1})
    missing = http.get("/v1/chat/completions/chatcmpl-no-such-job")
    unknown = http.get("/no/such/route")
    assert (refused.status_code, missing.status_code, unknown.status_code) == (400, 404, 404)
    after = scrape(http.get)

    usages = [streamed, done["usage"]]
    delta = lambda name, **labels: model_delta(before, after, name, model_name, **labels)  # noqa: E731
    # The refused requests never became jobs: only the two that ran are counted, once each, however they ran.
    for histogram in HISTOGRAMS[:2] + HISTOGRAMS[3:]:
        assert delta(f"{histogram}_count") == 2, histogram
        assert delta(f"{histogram}_sum") > 0
    assert delta("chatq:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("chatq:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    # One gap between each two tokens of a choice.
    assert delta("chatq:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    reasons = [streamed_reason, done["choices"][0]["finish_reason"]]
    for reason in set(reasons):
        assert delta("chatq:request_success_total", finished_reason=reason) == reasons.count(reason)
    # A job's first token came before its end, and its queue time before its first token.
    assert delta("chatq:e2e_request_latency_seconds_sum") > delta("chatq:time_to_first_token_seconds_sum")
    assert delta("chatq:time_to_first_token_seconds_sum") > delta("chatq:request_queue_time_seconds_sum") >= 0

    route = "/v1/chat/completions"
    assert http_delta(before, after, "POST", route, 200) == 1
    assert http_delta(before, after, "POST", route, 202) == 1
    assert http_delta(before, after, "POST", route, 400) == 1
    assert http_delta(before, after, "GET", "/v1/chat/completions/{job_id}", 404) == 1
    assert http_delta(before, after, "GET", "unmatched", 404) == 1
    assert http_delta(before, after, "GET", "/metrics", 200) == 1  # the first scrape


def test_histograms_are_cumulative_and_end_with_their_count(http: httpx.Client, model_name: str):
    http.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": 3})
    samples = scrape(http.get)
    for histogram in HISTOGRAMS:
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (name, labels), v in samples.items()
            if name == f"{histogram}_bucket" and dict(labels)["model_name"] == model_name
        )
        counts = [v for _, v in buckets]
        assert len(counts) > 10 and counts == sorted(counts), histogram
        assert buckets[-1] == (float("inf"), value(samples, f"{histogram}_count", model_name=model_name)) > (0, 0)


def test_a_running_job_shows_in_the_gauge_and_a_cancelled_one_as_abort(
    http: httpx.Client, r: redis.Redis, settings: Settings, model_name: str
):
    quiesce(r, settings)
    job = http.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": 2000, "background": True}).json()
    wait_for(http, job["id"], lambda j: j["status"] == "in_progress")
    during = scrape(http.get)
    assert value(during, "chatq:num_requests_running", model_name=model_name) == 1
    assert value(during, "chatq:num_requests_waiting", model_name=model_name) == 0
    assert http.post(f"/v1/chat/completions/{job['id']}/cancel").json()["status"] == "cancelled"
    deadline = time.time() + 30
    while r.sismember(keys.running(model_name), job["id"]):
        assert time.time() < deadline
        time.sleep(0.05)
    after = scrape(http.get)
    assert model_delta(during, after, "chatq:request_success_total", model_name, finished_reason="abort") == 1


def test_a_second_api_replica_reports_the_same_redis_backed_numbers(
    http: httpx.Client, settings: Settings, model_name: str
):
    http.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": 3})
    with TestClient(create_app(settings)) as replica:
        tries = 0
        while tries < 5:  # until no job ended between the first replica's two scrapes
            tries += 1
            first, other, again = scrape(http.get), scrape(replica.get), scrape(http.get)
            if shared(first) == shared(again):
                break
        assert shared(other) == shared(first)
        assert value(first, "chatq:e2e_request_latency_seconds_count", model_name=model_name) > 0
        # What each process answered is its own: the replica has answered only its scrapes (this one is counted
        # once answered).
        latest = scrape(replica.get)
        answered = {labels: v for (name, labels), v in latest.items() if name == "chatq:http_requests_total"}
        assert answered == {frozenset({("method", "GET"), ("route", "/metrics"), ("status", "200")}): tries}


def shared(samples: Samples) -> Samples:
    return {k: v for k, v in samples.items() if not k[0].startswith("chatq:http_requests")}


def test_metrics_need_no_api_key(settings: Settings):
    keyed = settings.model_copy(update={"api_keys": SecretStr("a-key-0123456789")})
    with TestClient(create_app(keyed)) as api:
        assert api.get("/v1/models").status_code == 401
        samples = scrape(api.get)
    assert value(samples, "chatq:http_requests_total", method="GET", route="/v1/models", status="401") == 1
