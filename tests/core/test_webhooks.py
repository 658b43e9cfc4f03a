"""The webhook outbox against a real Redis: which job ends push deliveries onto the webhook queue, in the script that
ends the job, and what those task messages carry; the webhook settings' checks."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator

import orjson
import pydantic
import pytest
import redis
import redis.asyncio as aioredis

from chatq.core import api_scripts, keys, reclaim_scripts, worker_scripts
from chatq.core.job import Event, EventKind
from chatq.core.queue import make_celery, task_message
from chatq.core.settings import Settings
from chatq.core.webhooks import WEBHOOK_TASK, WebhookMessages, event_type

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
URLS = ["http://127.0.0.1:9/a", "http://127.0.0.1:9/b"]


@pytest.fixture
def outbox(settings: Settings, r: redis.Redis) -> WebhookMessages:
    r.delete(keys.webhook_queue())
    hooked = settings.model_copy(update={"webhook_urls": ",".join(URLS), "webhook_secret": pydantic.SecretStr(SECRET)})
    made = WebhookMessages.of(hooked)
    assert made is not None
    return made


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    yield c
    await c.aclose()


def job(r: redis.Redis, status: str, background: bool = True, kind: str = "chat", worker: str = "w@1#1") -> str:
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    request = orjson.dumps({"messages": [], "background": background}).decode()
    fields = {"id": job_id, "model": "m", "kind": kind, "status": status, "request": request}
    r.hset(keys.job(job_id), mapping=fields | ({"worker": worker} if status == "in_progress" else {}))
    return job_id


def pushed(r: redis.Redis) -> list[tuple[str, list]]:
    """The webhook queue's task messages, oldest first: (task name, args)."""
    out = []
    for raw in reversed(r.lrange(keys.webhook_queue(), 0, -1)):
        envelope = orjson.loads(raw)
        args, _kwargs, _embed = orjson.loads(envelope["body"])
        out.append((envelope["headers"]["task"], args))
    return out


def end(r: redis.Redis, job_id: str, status: str, webhook: str, worker: str = "w@1#1") -> None:
    pipe = r.pipeline(transaction=True)
    worker_scripts.update_record(pipe, worker, job_id, "m", 60, {"status": status}, last=True, webhook=webhook)
    pipe.execute()


def test_a_background_jobs_end_pushes_one_delivery_per_url_once(r: redis.Redis, outbox: WebhookMessages) -> None:
    job_id = job(r, "in_progress")
    before = int(time.time())
    end(r, job_id, "completed", outbox.block(job_id))
    end(r, job_id, "completed", outbox.block(job_id))  # sent again, its reply lost: no second event
    got = pushed(r)
    assert [name for name, _ in got] == [WEBHOOK_TASK, WEBHOOK_TASK]
    assert [args[0] for _, args in got] == URLS
    event_ids = {args[1] for _, args in got}
    assert len(event_ids) == 1 and next(iter(event_ids)).startswith("evt_")
    assert {(args[2], args[4]) for _, args in got} == {(job_id, "chat.completed")}
    assert all(before <= args[3] <= time.time() for _, args in got)


def test_interactive_and_deleted_jobs_push_none(r: redis.Redis, outbox: WebhookMessages) -> None:
    interactive = job(r, "in_progress", background=False)
    end(r, interactive, "completed", outbox.block(interactive))
    deleted = job(r, "in_progress")
    r.hset(keys.job(deleted), "deleted", "1")
    end(r, deleted, "cancelled", outbox.block(deleted))
    moved = job(r, "in_progress", worker="w@2#2")  # another worker took it over: this one's end is not the job's
    end(r, moved, "failed", outbox.block(moved))
    assert pushed(r) == []


async def test_a_queued_job_cancelled_pushes_its_cancelled_delivery(
    r: redis.Redis, client: aioredis.Redis, outbox: WebhookMessages
) -> None:
    closing = [Event(seq=1, event=EventKind.done)]
    cancelled, deleted, running = job(r, "queued", kind="text"), job(r, "queued"), job(r, "in_progress")
    assert await api_scripts.cancel(client, cancelled, 60, False, closing, outbox.block(cancelled)) == "queued"
    assert await api_scripts.cancel(client, cancelled, 60, False, closing, outbox.block(cancelled)) == "cancelled"
    assert await api_scripts.cancel(client, deleted, 60, True, closing, outbox.block(deleted)) == "queued"
    # A running job is only flagged: its worker's last write sends its event.
    assert await api_scripts.cancel(client, running, 60, False, closing, outbox.block(running)) == "in_progress"
    # One delivery to each URL, sent once however often it is cancelled.
    assert [(args[0], args[2], args[4]) for _, args in pushed(r)] == [(u, cancelled, "text.cancelled") for u in URLS]


def test_a_job_failed_by_the_reclaim_pushes_its_failed_delivery(
    r: redis.Redis, outbox: WebhookMessages, settings: Settings
) -> None:
    job_id = job(r, "in_progress", worker="w@dead#1")
    queue, message = task_message(make_celery(settings), job_id, keys.celery_queue("m"), 0)
    r.hset(keys.job(job_id), "attempts", "3")
    error = {"error": {"message": "lost", "type": "server_error", "param": None, "code": 500}}
    how = reclaim_scripts.Requeue(queue, message, 1.0, 3, 60, error, webhook=outbox.block(job_id))
    assert reclaim_scripts.reclaim(r, job_id, "m", "w@dead#1", 5, how) == "failed"
    assert [(args[2], args[4]) for _, args in pushed(r)] == [(job_id, "chat.failed")] * len(URLS)


def test_event_types_by_kind_and_status() -> None:
    assert event_type("response.incomplete") == "response.incomplete"
    assert event_type("chat.cancelled") == "chat.completion.cancelled"
    assert event_type("text.completed") == "text_completion.completed"
    assert event_type("batch.expired") == "batch.expired" and event_type("batch.completed") == "batch.completed"
    assert event_type("chat.in_progress") is None and event_type("unknown.completed") is None
    assert event_type("chat.expired") is None and event_type("batch.incomplete") is None


@pytest.mark.parametrize("secret", ["secret", "whsec_", "whsec_not base64!", "whsec_YWJ"])
def test_a_secret_that_is_not_whsec_base64_is_refused(secret: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="whsec_"):
        Settings(webhook_secret=secret)


def test_webhook_urls_need_a_secret() -> None:
    with pytest.raises(pydantic.ValidationError, match="CHATQ_WEBHOOK_SECRET"):
        Settings(webhook_urls="http://127.0.0.1/hooks")
    settings = Settings(webhook_urls=" http://a/h , http://b/h,", webhook_secret=SECRET)
    assert settings.webhook_url_list == ["http://a/h", "http://b/h"] and SECRET not in repr(settings)
    assert WebhookMessages.of(Settings()) is None
