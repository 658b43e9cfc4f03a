"""Webhooks for background jobs: the thin event a job's end sends, the task messages its last write pushes (an
outbox: the delivery is enqueued in the same script that ends the job), and the Celery app of the webhook queue.

The job's script knows whether the job is a background one and how it ended; the messages are built here beforehand,
one per URL, each split around the place where the script writes "<kind>.<status>" (its record's kind, its status).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from celery import Celery

from chatq.core import keys
from chatq.core.queue import make_celery, redis_envelope
from chatq.core.settings import Settings

WEBHOOK_TASK = "chatq.webhook"

# The event type's first part, by the job's kind: OpenAI's for responses; for chat and legacy completions the name
# of their object, which OpenAI sends no webhooks for.
EVENT_PREFIXES = {"response": "response", "chat": "chat.completion", "text": "text_completion", "batch": "batch"}
END_STATUSES = ("completed", "failed", "cancelled", "incomplete")
# A batch's ends, OpenAI's batch.* events.
BATCH_END_STATUSES = ("completed", "failed", "cancelled", "expired")


def event_type(end: str) -> str | None:
    """The event type of a job's end as its script writes it ("<kind>.<status>"); None for one that sends none."""
    kind, _, status = end.partition(".")
    prefix = EVENT_PREFIXES.get(kind)
    ends = BATCH_END_STATUSES if kind == "batch" else END_STATUSES
    return f"{prefix}.{status}" if prefix and status in ends else None


def thin_event(event_id: str, job_id: str, created_at: int, end: str) -> dict[str, Any] | None:
    """OpenAI's webhook body: the event names the job, which the receiver reads with GET if it needs more."""
    type_ = event_type(end)
    if type_ is None:
        return None
    return {"id": event_id, "object": "event", "created_at": created_at, "type": type_, "data": {"id": job_id}}


def visibility_timeout(settings: Settings) -> float:
    """Seconds after which a delivery a webhook worker took and never acknowledged (it was killed) goes to another:
    longer than a retry's wait and its POST together, as kombu counts a retried delivery's wait as held."""
    return 2 * (settings.webhook_backoff_max + settings.webhook_timeout)


def make_webhook_celery(settings: Settings) -> Celery:
    """chatq's Celery app for the webhook queue: its own unacknowledged-message keys, so its short visibility
    timeout never redelivers a generation job, and lane 0 only."""
    app = make_celery(settings)
    options = dict(app.conf.broker_transport_options)
    visibility = visibility_timeout(settings)
    options.update(
        visibility_timeout=visibility,
        # kombu looks for such deliveries every 100 s by default: every quarter of the timeout here, 10 s at most.
        unacked_restore_interval=min(10, max(1, int(visibility / 4))),
        unacked_restore_throttle=1,
        unacked_key=keys.webhook_unacked("unacked"),
        unacked_index_key=keys.webhook_unacked("unacked_index"),
        unacked_mutex_key=keys.webhook_unacked("unacked_mutex"),
    )
    app.conf.update(task_default_queue=keys.webhook_queue(), task_default_priority=0, broker_transport_options=options)
    return app


class WebhookMessages:
    """The webhook messages of a job's end, for the script that ends the job to push if it ends a background job."""

    def __init__(self, app: Celery, urls: list[str]):
        self.app = app
        self.urls = urls

    @classmethod
    def of(cls, settings: Settings) -> WebhookMessages | None:
        """None without webhook URLs: the scripts then push nothing."""
        urls = settings.webhook_url_list
        return cls(make_webhook_celery(settings), urls) if urls else None

    def block(self, job_id: str) -> str:
        """The script's argument: the queue and, per URL, the message in two parts around "<kind>.<status>". One
        event id for all, which each retry keeps as its webhook-id."""
        event_id, now = f"evt_{uuid.uuid4().hex}", int(time.time())
        messages = [self._message(url, event_id, job_id, now) for url in self.urls]
        return orjson.dumps({"queue": keys.webhook_queue(), "messages": messages}).decode()

    def _message(self, url: str, event_id: str, job_id: str, now: int) -> list[str]:
        marker = f"chatqend{uuid.uuid4().hex}"
        args = [url, event_id, job_id, now, marker]
        msg = self.app.amqp.as_task_v2(
            str(uuid.uuid4()),
            WEBHOOK_TASK,
            args=args,
            ignore_result=None,
            argsrepr=repr([url, event_id, job_id, now]),
            kwargsrepr="{}",
        )
        # The body as plain JSON (no body_encoding), so the script's words land in it as they are.
        envelope = redis_envelope(msg, keys.webhook_queue(), 0, base64_body=False)
        before, after = orjson.dumps(envelope).decode().split(marker)
        return [before, after]
