"""What a request must pass before it becomes a job: the body limit, the bounds on its lists, the cap on waiting
jobs; and what admission must not cost others: a big prompt renders off the event loop. Idempotency keys and the
priority of interactive requests over background jobs."""

from __future__ import annotations

import asyncio
import functools
import json
import select
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from chatq.core import keys
from chatq.core.requests import MAX_MESSAGES, MAX_TOOLS
from chatq.core.settings import Settings
from tests.api.conftest import Guarded
from tests.api.test_metrics import http_delta, scrape, value
from tests.helpers import assert_error, cancel_job, content_of, snapshot, stream, wait_for

M = [{"role": "user", "content": "hi"}]
TOO_LARGE = "RequestTooLargeError"


def _raw_request(base: str, head: bytes, body_chunks: list[bytes]) -> tuple[int, dict]:
    """Sends a request by hand, stopping as soon as the server answers; its status and JSON body."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:  # answered already: the rest is never read
                break
            try:
                sock.sendall(chunk)
            except OSError:
                break
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            part = sock.recv(65536)
            if not part:
                break
            data += part
    status_line, rest = data.split(b"\r\n", 1)
    return int(status_line.split()[1]), json.loads(rest.split(b"\r\n\r\n", 1)[1])


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def _head(path: str, extra: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra}\r\n".encode()


def test_a_body_over_the_limit_by_its_content_length_is_refused_unread(stack: str, r: redis.Redis, model_name):
    before = snapshot(r, model_name)
    limit = Settings().max_body_bytes
    # The body is never sent: the answer comes on the headers alone.
    status, body = _raw_request(stack, _head("/v1/chat/completions", f"Content-Length: {limit + 1}\r\n"), [])
    assert status == 413 and body["error"]["type"] == TOO_LARGE and body["error"]["code"] == 413
    assert snapshot(r, model_name) == before


def test_a_chunked_body_is_refused_once_it_passes_the_limit(stack: str, r: redis.Redis, model_name):
    before = snapshot(r, model_name)
    limit = Settings().max_body_bytes
    piece = b"x" * 65536
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (limit // len(piece) + 64)  # the final chunk is never sent
    status, body = _raw_request(stack, _head("/v1/chat/completions", "Transfer-Encoding: chunked\r\n"), chunks)
    assert status == 413 and body["error"]["type"] == TOO_LARGE
    assert snapshot(r, model_name) == before


def test_a_body_within_the_limit_is_read_with_a_length_or_chunked(http: httpx.Client):
    data = json.dumps({"prompt": "hi" + " " * 1_000_000}).encode()
    headers = {"Content-Type": "application/json"}
    for content in (data, iter([data[:500_000], data[500_000:]])):
        resp = http.post("/tokenize", content=content, headers=headers)
        assert resp.status_code == 200 and resp.json()["count"] > 1, resp.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": M * (MAX_MESSAGES + 1)}, "messages"),
        (
            {
                "messages": M,
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)],
            },
            "tools",
        ),
        ({"messages": M, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_too_many_messages_tools_or_stop_strings_are_a_400(http: httpx.Client, r, model_name, body, param):
    before = snapshot(r, model_name)
    assert_error(http.post("/v1/chat/completions", json=body), 400, "BadRequestError", param)
    assert snapshot(r, model_name) == before


async def test_health_answers_while_big_prompts_render(stack: str):
    limit = Settings().max_body_bytes

    def body(size: int) -> bytes:
        # Far beyond the context, each ends a 400 once rendered and tokenized whole: its time is all rendering,
        # seconds for a prompt near the body limit.
        return json.dumps({"messages": [{"role": "user", "content": "hello world " * (size // 12)}]}).encode()

    # Of different lengths, so they end one after another, seconds apart: once the first is answered, the others
    # are still rendering.
    bodies = [body(limit * k // 4 - 1024) for k in (4, 3, 2, 1)]
    async with httpx.AsyncClient(base_url=stack, timeout=300) as http:
        post = functools.partial(http.post, "/v1/chat/completions", headers={"Content-Type": "application/json"})
        bigs = [asyncio.create_task(post(content=b)) for b in bodies]
        first, _ = await asyncio.wait(bigs, return_when=asyncio.FIRST_COMPLETED)
        health = await http.get("/health")
        # Rendered on the event loop, the next prompt's rendering would start before /health is read, and its
        # answer would come first.
        finished_meanwhile = {b for b in bigs if b.done()} - first
        answers = await asyncio.gather(*bigs)
    assert health.status_code == 200
    assert not finished_meanwhile, "a big prompt's rendering held up /health"
    for a in answers:
        assert_error(a, 400, "BadRequestError", "input_tokens")


def _background(http: httpx.Client, max_tokens: int, headers: dict | None = None, **extra) -> httpx.Response:
    body = {"messages": M, "max_tokens": max_tokens, "temperature": 0, "background": True, **extra}
    return http.post("/v1/chat/completions", json=body, headers=headers or {})


def test_a_repeated_idempotency_key_answers_with_the_same_job_in_every_mode(
    http: httpx.Client, r: redis.Redis, model_name
):
    idem = {"Idempotency-Key": f"order 66 / {uuid.uuid4()}"}
    first = _background(http, 8, idem)
    assert first.status_code == 202, first.text
    job_id = first.json()["id"]
    before = snapshot(r, model_name)
    again = _background(http, 8, idem)
    assert again.status_code == 202 and again.json()["id"] == job_id
    # Streamed: the job's stream from its start. Waited for: its answer.
    fs = stream(http, "POST", "/v1/chat/completions", json={"messages": M, "stream": True}, headers=idem)
    assert {f.json["id"] for f in fs[:-1]} == {job_id} and fs[0].id == 1 and fs[-1].data == "[DONE]"
    waited = http.post("/v1/chat/completions", json={"messages": M}, headers=idem)
    assert waited.status_code == 200 and waited.json()["id"] == job_id
    assert waited.json()["choices"][0]["message"]["content"] == content_of(fs)
    assert snapshot(r, model_name)[0] == before[0]  # no second job
    # The key outlives the job's end by the result TTL, then goes with it; a deleted job's key is free at once.
    assert 0 < r.ttl(keys.idempotency("", idem["Idempotency-Key"])) <= Settings().result_ttl
    assert http.delete(f"/v1/chat/completions/{job_id}").status_code == 200
    fresh = _background(http, 2, idem)
    assert fresh.status_code == 202 and fresh.json()["id"] != job_id


def test_an_idempotency_key_is_bound_to_its_route_kind_only_by_the_job_it_names(http: httpx.Client):
    # The same key on the legacy route names the same job: the key, not the route or the body, identifies it.
    idem = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    job_id = _background(http, 2, idem).json()["id"]
    other = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "background": True}, headers=idem)
    assert other.status_code == 202 and other.json()["id"] == job_id


def test_an_idempotency_key_of_a_completion_is_refused_by_the_responses_api_and_back(
    http: httpx.Client, r: redis.Redis, model_name
):
    chat_key, response_key = ({"Idempotency-Key": f"k-{uuid.uuid4()}"} for _ in range(2))
    job_id = _background(http, 2, chat_key).json()["id"]
    created = http.post(
        "/v1/responses", json={"input": "x", "max_output_tokens": 16, "background": True}, headers=response_key
    )
    assert created.status_code == 200, created.text
    before = snapshot(r, model_name)
    crossed = http.post("/v1/responses", json={"input": "x", "background": True}, headers=chat_key)
    assert_error(crossed, 409, "ConflictError", "Idempotency-Key")
    assert job_id in crossed.json()["error"]["message"]
    back = _background(http, 2, response_key)
    assert_error(back, 409, "ConflictError", "Idempotency-Key")
    assert created.json()["id"] in back.json()["error"]["message"]
    assert snapshot(r, model_name)[0] == before[0]  # no job was created


@pytest.mark.parametrize("key", ["x" * 256, "tab\there", "caf\u00e9"])
def test_an_invalid_idempotency_key_is_a_400(http: httpx.Client, r: redis.Redis, model_name, key: str):
    before = snapshot(r, model_name)
    resp = _background(http, 2, {"Idempotency-Key": key.encode("latin-1")})
    assert_error(resp, 400, "BadRequestError", "Idempotency-Key")
    # No job, task or place in the queue was added (the test before's jobs may still be leaving the queue).
    jobs, queued, waiting = snapshot(r, model_name)
    assert jobs == before[0] and queued <= before[1] and waiting <= before[2]


def _busy(guarded: Guarded, http: httpx.Client) -> list[str]:
    """Jobs that hold every task thread of the guarded stack's worker until cancelled."""
    holders = []
    for _ in range(guarded.settings.worker_concurrency):
        resp = _background(http, 2000, ignore_eos=True)
        assert resp.status_code == 202, resp.text
        holders.append(resp.json()["id"])
    for h in holders:
        wait_for(http, h, lambda j: j["status"] == "in_progress")
    return holders


def test_interactive_requests_overtake_background_jobs_and_a_full_queue_is_a_429(guarded: Guarded):
    settings, r = guarded.settings, guarded.r
    with guarded.client() as http:
        holders = _busy(guarded, http)
        try:
            waiting = [_background(http, 2).json()["id"] for _ in range(settings.max_queued - 1)]
            positions = [http.get(f"/v1/chat/completions/{j}").json()["progress"]["queue_position"] for j in waiting]
            assert positions == [1, 2]
            with ThreadPoolExecutor(1) as pool:
                body = {"messages": M, "max_tokens": 2, "temperature": 0}
                interactive_id = f"interactive-{uuid.uuid4().hex}"
                headers = {"X-Request-Id": interactive_id}
                answer = pool.submit(http.post, "/v1/chat/completions", json=body, headers=headers)
                wait_for(http, f"chatcmpl-{interactive_id}", lambda j: j.get("status") == "queued")
                # Ahead of the background jobs in the queue, as in the worker's pick order.
                moved = [http.get(f"/v1/chat/completions/{j}").json()["progress"]["queue_position"] for j in waiting]
                assert moved == [2, 3]
                _assert_full(guarded, http)
                cancel_job(settings, holders[0])  # one task thread frees: it takes the interactive request
                assert answer.result(timeout=120).status_code == 200
        finally:
            for h in holders:
                cancel_job(settings, h)
        for j in waiting:
            wait_for(http, j, lambda v: v["status"] == "completed")
        started = {j: float(r.hget(keys.job(j), "started")) for j in [f"chatcmpl-{interactive_id}", *waiting]}
        assert min(started, key=started.__getitem__) == f"chatcmpl-{interactive_id}"


def _assert_full(guarded: Guarded, http: httpx.Client) -> None:
    """With max_queued jobs waiting, a new request in any mode is a 429 that enqueues nothing."""
    model = guarded.settings.model_name
    before = snapshot(guarded.r, model)
    assert before[2] == guarded.settings.max_queued
    scraped = scrape(http.get)
    for extra in ({"background": True}, {"stream": True}, {}):
        resp = http.post("/v1/chat/completions", json={"messages": M, "max_tokens": 2, **extra})
        assert_error(resp, 429, "RateLimitError", None)
        assert int(resp.headers["retry-after"]) >= 1
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert_error(resp, 429, "RateLimitError", None)
    assert snapshot(guarded.r, model) == before
    # /metrics shows the full queue, the busy task threads and the refusals.
    assert value(scraped, "chatq:num_requests_waiting", model_name=model) == guarded.settings.max_queued
    assert value(scraped, "chatq:num_requests_running", model_name=model) == guarded.settings.worker_concurrency
    now = scrape(http.get)
    assert http_delta(scraped, now, "POST", "/v1/chat/completions", 429) == 3
    assert http_delta(scraped, now, "POST", "/v1/completions", 429) == 1
