"""Background jobs: submit, poll, retrieve, resume streams, cancel, delete."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import redis
import redis.asyncio as aioredis

from chatq.api.jobs import JobStore
from chatq.core import keys
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.job import Job, JobStatus
from chatq.core.queue import celery_priority, make_celery, task_message
from chatq.core.settings import Settings
from tests.helpers import cancel_job, content_of, frames, stream, wait_for

LONG = [{"role": "user", "content": "Count from 1 to 200, one number per line."}]


def submit(http: httpx.Client, max_tokens: int, **extra) -> dict:
    resp = http.post(
        "/v1/chat/completions",
        json={"messages": LONG, "max_tokens": max_tokens, "temperature": 0, "background": True, **extra},
    )
    assert resp.status_code == 202, resp.text
    return resp.json()


def test_a_background_text_completion_is_one_in_every_state(http: httpx.Client):
    resp = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, "background": True})
    assert resp.status_code == 202 and resp.json()["object"] == "text_completion"
    done = wait_for(http, resp.json()["id"], lambda j: j["status"] == "completed")
    assert done["object"] == "text_completion" and done["choices"][0]["text"]


def test_background_job_is_polled_retrieved_and_deleted(http: httpx.Client, client: openai.OpenAI):
    job = submit(http, 12)
    assert job["status"] == "queued" and job["choices"] == [] and job["object"] == "chat.completion"
    done = wait_for(http, job["id"], lambda j: j["status"] == "completed")
    assert done["progress"]["completion_tokens"] == 12

    got = client.chat.completions.retrieve(job["id"])
    assert got.id == job["id"]
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    assert got.model_extra["status"] == "completed"

    deleted = client.chat.completions.delete(job["id"])
    assert deleted.deleted is True and deleted.id == job["id"]
    assert http.get(f"/v1/chat/completions/{job['id']}").status_code == 404


def test_late_subscriber_gets_every_event_once_in_order(http: httpx.Client):
    job = submit(http, 60)
    wait_for(http, job["id"], lambda j: j["progress"]["completion_tokens"] >= 5)
    fs = stream(http, "GET", f"/v1/chat/completions/{job['id']}", params={"stream": "true"})
    assert [f.id for f in fs] == list(range(1, len(fs) + 1))
    assert fs[-1].data == "[DONE]"
    final = http.get(f"/v1/chat/completions/{job['id']}").json()
    assert content_of(fs) == final["choices"][0]["message"]["content"]
    assert final["usage"]["completion_tokens"] == 60

    # Resuming after event k replays exactly the events after it.
    k = len(fs) // 2
    rest = stream(
        http, "GET", f"/v1/chat/completions/{job['id']}", params={"stream": "true"}, headers={"Last-Event-ID": str(k)}
    )
    assert [(f.id, f.data) for f in rest] == [(f.id, f.data) for f in fs[k:]]
    after = stream(
        http, "GET", f"/v1/chat/completions/{job['id']}", params={"stream": "true", "starting_after": str(k + 3)}
    )
    assert [f.id for f in after] == [f.id for f in fs[k + 3 :]]
    # A browser's EventSource reconnects to the URL it opened, with the last event it got in the header.
    reconnected = stream(
        http,
        "GET",
        f"/v1/chat/completions/{job['id']}",
        params={"stream": "true", "starting_after": "2"},
        headers={"Last-Event-ID": str(k)},
    )
    assert [f.id for f in reconnected] == [f.id for f in fs[k:]]

    # Resuming from the last event (as a browser's EventSource does after [DONE]): nothing is left, and a 204,
    # rather than a stream that never ends, says so.
    url = f"/v1/chat/completions/{job['id']}"
    assert http.get(url, params={"stream": "true"}, headers={"Last-Event-ID": str(fs[-1].id)}).status_code == 204
    assert http.get(url, params={"stream": "true", "starting_after": "999999"}).status_code == 204
    params = {"stream": "true", "starting_after": "2"}
    assert http.get(url, params=params, headers={"Last-Event-ID": str(fs[-1].id)}).status_code == 204
    # Numbers that cannot be events are a 400 naming where they came from.
    for params, headers, param in (
        ({"starting_after": str(2**64)}, {}, "starting_after"),
        ({"starting_after": "-1"}, {}, "starting_after"),
        ({}, {"Last-Event-ID": "-5"}, "Last-Event-ID"),
        ({}, {"Last-Event-ID": "x"}, "Last-Event-ID"),
        ({}, {"Last-Event-ID": "\u00b2".encode("latin-1")}, "Last-Event-ID"),  # a digit to isdigit(), not to int()
    ):
        bad = http.get(url, params={"stream": "true", **params}, headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_a_stream_resumed_past_a_running_jobs_end_ends_with_it(http: httpx.Client):
    job = submit(http, 60)
    fs = stream(http, "GET", f"/v1/chat/completions/{job['id']}", params={"stream": "true", "starting_after": "5000"})
    assert fs == [] and http.get(f"/v1/chat/completions/{job['id']}").json()["status"] == "completed"


def test_live_stream_joined_mid_job_matches_the_log(http: httpx.Client, r: redis.Redis):
    job = submit(http, 80)
    wait_for(http, job["id"], lambda j: j["progress"]["completion_tokens"] >= 3)
    fs = stream(http, "GET", f"/v1/chat/completions/{job['id']}", params={"stream": "true"})
    # What a direct Redis reader of the documented log sees is the same sequence.
    log = [json.loads(fields["msg"]) for _, fields in r.xrange(keys.events(job["id"]))]
    assert [e["seq"] for e in log] == [f.id for f in fs]
    assert log[-1]["event"] == "done"
    assert [e["data"] for e in log[:-1]] == [f.json for f in fs[:-1]]


def test_cancel_stops_a_running_job(http: httpx.Client):
    job = submit(http, 2000, stop=[])
    running = wait_for(http, job["id"], lambda j: j["progress"]["completion_tokens"] >= 5)
    assert running["status"] == "in_progress"
    at_cancel = running["progress"]["completion_tokens"]
    # The answer comes once the worker dropped the job, at its next step; the API waits for that only so long
    # (CANCEL_WAIT), and a slow, busy machine may take longer over two steps, so then the job is read until it ends.
    cancelled = http.post(f"/v1/chat/completions/{job['id']}/cancel").json()
    assert cancelled["id"] == job["id"] and cancelled["status"] in ("cancelled", "in_progress")
    if cancelled["status"] == "in_progress":
        cancelled = wait_for(http, job["id"], lambda j: j["status"] != "in_progress", timeout=60)
    assert cancelled["status"] == "cancelled"
    # The count read before the cancel may lag by the quarter second between progress writes: a few tokens
    # more, not the remaining 1,900.
    assert cancelled["progress"]["completion_tokens"] - at_cancel <= 10
    # Idempotent, and the stream of a cancelled job still ends.
    assert http.post(f"/v1/chat/completions/{job['id']}/cancel").json()["status"] == "cancelled"
    fs = stream(http, "GET", f"/v1/chat/completions/{job['id']}", params={"stream": "true"})
    assert fs[-1].data == "[DONE]"


def test_a_job_deleted_while_running_stays_deleted_and_its_id_can_be_used_again(http: httpx.Client, r: redis.Redis):
    job = submit(http, 2000, stop=[], request_id="deleted-while-running")
    wait_for(http, job["id"], lambda j: j["progress"]["completion_tokens"] >= 3)
    assert http.delete(f"/v1/chat/completions/{job['id']}").json()["deleted"] is True
    for method, suffix in (("GET", ""), ("POST", "/cancel"), ("DELETE", ""), ("GET", "?stream=true")):
        assert http.request(method, f"/v1/chat/completions/{job['id']}{suffix}").status_code == 404

    # The id is taken until the worker stopped the run (at its next step), then free, and the record and log are gone.
    deadline = time.time() + 60  # two steps of the worker's, seconds each on a slow, busy machine
    body = {
        "messages": LONG,
        "max_tokens": 8,
        "temperature": 0,
        "background": True,
        "request_id": "deleted-while-running",
    }
    while (again := http.post("/v1/chat/completions", json=body)).status_code == 409:
        assert time.time() < deadline, "the deleted job's id was never freed"
        time.sleep(0.02)
    assert again.status_code == 202, again.text
    # The new job's log is its own: numbered from 1, with none of the old run's events.
    done = wait_for(http, job["id"], lambda j: j["status"] == "completed")
    assert done["progress"]["completion_tokens"] == 8
    fs = stream(http, "GET", f"/v1/chat/completions/{job['id']}", params={"stream": "true"})
    assert [f.id for f in fs] == list(range(1, len(fs) + 1))
    assert content_of(fs) == done["choices"][0]["message"]["content"]


def test_client_disconnect_cancels_a_streamed_job(http: httpx.Client):
    body = {"messages": LONG, "max_tokens": 2000, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        seen = []
        for f in frames(resp.iter_lines()):
            seen.append(f)
            if len(seen) == 4:
                break
    job_id = seen[0].json["id"]
    # The disconnect is noticed at once, but the worker drops the job only at its next steps, which on a slow,
    # busy machine take seconds each: a generous deadline (met as soon as the job ends), the token bound is the check.
    final = wait_for(http, job_id, lambda j: j["status"] == "cancelled", timeout=60)
    assert final["progress"]["completion_tokens"] < 100


def test_disconnect_does_not_cancel_a_background_stream(http: httpx.Client):
    body = {"messages": LONG, "max_tokens": 30, "temperature": 0, "stream": True, "background": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        first = next(frames(resp.iter_lines()))
    final = wait_for(http, first.json["id"], lambda j: j["status"] != "in_progress" and j["status"] != "queued")
    assert final["status"] == "completed"
    assert final["usage"]["completion_tokens"] == 30


def test_queued_job_shows_its_position_and_can_be_cancelled(
    http: httpx.Client, r: redis.Redis, settings: Settings, model_name
):
    # Jobs that never end on their own hold every one of the worker's task threads, so whatever comes after them
    # cannot start: it waits in the queue, with a position, until they are cancelled.
    holders = [submit(http, 2000, ignore_eos=True) for _ in range(settings.worker_concurrency)]
    try:
        for h in holders:
            wait_for(http, h["id"], lambda j: j["status"] == "in_progress")
        jobs = [submit(http, 40) for _ in range(4)]
        views = [http.get(f"/v1/chat/completions/{j['id']}").json() for j in jobs]
        assert [v["status"] for v in views] == ["queued"] * len(jobs)
        positions = [v["progress"]["queue_position"] for v in views]
        assert positions[0] >= 1 and positions == list(range(positions[0], positions[0] + len(jobs)))
        last = jobs[-1]["id"]
        view = http.post(f"/v1/chat/completions/{last}/cancel").json()
        assert view["status"] == "cancelled"
        assert r.zrank(keys.queued(model_name), last) is None
        # Clients waiting for a queued job's answer learn it was cancelled: each choice ends with `abort`.
        waiter_id, streamer_id = f"waiter-{uuid.uuid4().hex}", f"streamer-{uuid.uuid4().hex}"
        body = {"messages": LONG, "max_tokens": 5, "n": 2, "temperature": 1}
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(http.post, "/v1/chat/completions", json=body, headers={"X-Request-Id": waiter_id})
            streaming = pool.submit(
                stream,
                http,
                "POST",
                "/v1/chat/completions",
                json={**body, "stream": True},
                headers={"X-Request-Id": streamer_id},
            )
            for job_id in (waiter_id, streamer_id):
                wait_for(http, f"chatcmpl-{job_id}", lambda j: j.get("status") == "queued")
                http.post(f"/v1/chat/completions/chatcmpl-{job_id}/cancel")
            answer = waiting.result(timeout=30)
            streamed = streaming.result(timeout=30)
        assert [f.data for f in streamed][-1] == "[DONE]"
        closing = [(c["index"], c["delta"], c["finish_reason"]) for f in streamed[:-1] for c in f.json["choices"]]
        assert closing == [
            (0, {"role": "assistant", "content": ""}, None),
            (0, {}, "abort"),
            (1, {"role": "assistant", "content": ""}, None),
            (1, {}, "abort"),
        ]
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["status"] == "cancelled" and body["usage"]["completion_tokens"] == 0
        assert [(c["index"], c["finish_reason"], c["message"]["content"]) for c in body["choices"]] == [
            (0, "abort", ""),
            (1, "abort", ""),
        ]
    finally:
        # Straight to Redis, all at once: the API's cancel answers only once the worker dropped the job (up to
        # CANCEL_WAIT), and 32 of those one after another, each over two steps of a full batch on a slow machine,
        # could take minutes of this test's time limit. The holders are waited for below.
        for h in holders:
            cancel_job(settings, h["id"])
    for j in jobs[:-1]:
        done = wait_for(http, j["id"], lambda j: j["status"] in ("completed", "cancelled", "failed"), timeout=300)
        assert done["status"] == "completed" and done["progress"]["completion_tokens"] == 40
    for h in holders:  # the tests after this one get an idle worker
        wait_for(http, h["id"], lambda j: j["status"] == "cancelled", timeout=60)
    final = http.get(f"/v1/chat/completions/{last}").json()
    assert final["status"] == "cancelled" and final["progress"]["completion_tokens"] == 0
    assert [c["finish_reason"] for c in final["choices"]] == ["abort"]


def test_a_queued_job_of_another_model_leaves_its_own_queue_when_cancelled(settings: Settings, r: redis.Redis):
    # Job ids are global, so any API may cancel a job: the job's own model's queue must lose it. Its log key holding
    # another type of value must not stop the cancel either.
    async def submit_elsewhere() -> str:
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        try:
            store = JobStore(client, make_celery(settings), settings)
            request = ChatCompletionRequest(messages=LONG)
            job = (await store.submit(request, "chat", "another-model", [[1, 2, 3]], None)).job
            return job.id
        finally:
            await client.aclose()

    job_id = asyncio.run(submit_elsewhere())
    for queue in r.scan_iter(keys.celery_queue("another-model") + "*"):  # its task: no worker serves that model
        r.delete(queue)
    assert r.zscore(keys.queued("another-model"), job_id) is not None
    r.set(keys.events(job_id), "not a log")
    cancel_job(settings, job_id)
    assert r.zscore(keys.queued("another-model"), job_id) is None
    assert r.hget(keys.job(job_id), "status") == "cancelled" and r.ttl(keys.job(job_id)) > 0


def test_a_job_whose_record_the_worker_cannot_read_fails_instead_of_hanging(stack, settings, r, model_name):
    # A record written by another version of chatq, say: the job ends failed, with its error in the stream.
    job = Job(
        id=f"chatcmpl-unreadable-{uuid.uuid4().hex}", model=model_name, request=ChatCompletionRequest(messages=LONG)
    )
    r.hset(keys.job(job.id), mapping=job.to_redis() | {"request": '{"written_by": "another version"}'})
    r.zadd(keys.queued(model_name), {job.id: time.time()})
    queue, message = task_message(make_celery(settings), job.id, keys.celery_queue(model_name), celery_priority(0))
    r.lpush(queue, message)
    deadline = time.time() + 30
    while r.hget(keys.job(job.id), "status") != "failed":
        assert time.time() < deadline, (r.hget(keys.job(job.id), "status"), r.hget(keys.job(job.id), "attempts"))
        time.sleep(0.05)
    events = [json.loads(f["msg"]) for _, f in r.xrange(keys.events(job.id))]
    assert [e["event"] for e in events] == ["error", "done"]
    assert "cannot read the job's record" in events[0]["data"]["error"]["message"]
    assert r.ttl(keys.job(job.id)) > 0 and r.zscore(keys.queued(model_name), job.id) is None


def test_a_log_entry_the_relay_cannot_read_ends_the_stream_with_an_error_and_leaves_the_job_alone(
    http: httpx.Client, r: redis.Redis, model_name: str
):
    # A running job whose log holds an entry no version of chatq wrote: the relay fails on it.
    job = Job(
        id=f"chatcmpl-garbled-{uuid.uuid4().hex}",
        model=model_name,
        request=ChatCompletionRequest(messages=LONG),
        status=JobStatus.in_progress,
    )
    r.hset(keys.job(job.id), mapping=job.to_redis())
    r.xadd(keys.events(job.id), {"msg": "not an event"}, id="0-1")
    try:
        fs = stream(http, "GET", f"/v1/chat/completions/{job.id}", params={"stream": "true"})
        # The stream ends, not hangs, and says why; numbered as the last event relayed, for resuming.
        assert [f.id for f in fs] == [0, 0] and fs[-1].data == "[DONE]"
        error = fs[0].json["error"]
        assert error["code"] == 500 and "resume the stream" in error["message"]
        assert r.hget(keys.job(job.id), "status") == "in_progress"
    finally:
        r.delete(keys.job(job.id), keys.events(job.id))
