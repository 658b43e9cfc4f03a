"""The webhook worker: delivers the events that background jobs' ends pushed onto the webhook queue.

Run as `celery -A chatq.worker.webhooks worker -P threads -Q chatq.webhooks` (what `chatq webhooks` does): no model,
no torch, so a slow or dead receiver costs this process threads, never a generation step. A delivery is acknowledged
once it is done (delivered, refused or given up), so a worker killed meanwhile leaves it to be delivered again.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import httpx
import orjson
from celery import Task, signals
from standardwebhooks import Webhook

from chatq.core import logs
from chatq.core.settings import Settings
from chatq.core.webhooks import WEBHOOK_TASK, make_webhook_celery, thin_event

log = logging.getLogger(__name__)
settings = Settings()
logs.celery_worker(settings.log_format)
app = make_webhook_celery(settings)

# Answers that a later attempt may turn into a delivery: the receiver's own trouble, a timeout, a rate limit.
RETRIED = {408, 429}
# Shared by the pool's threads; no redirects, as a receiver that moved must be configured anew.
_http = httpx.Client(timeout=settings.webhook_timeout, follow_redirects=False)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _log_format(logger: logging.Logger, **_kwargs) -> None:
    logs.adopt(logger, settings.log_format)


def signed_headers(secret: str, webhook_id: str, body: str, now: datetime) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt: its own timestamp (receivers refuse old ones), the same id."""
    return {
        "content-type": "application/json",
        "webhook-id": webhook_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": Webhook(secret).sign(webhook_id, now, body),
    }


def retried(status: int) -> bool:
    return status >= 500 or status in RETRIED


def backoff(retries: int, settings: Settings) -> float:
    """Seconds before the next attempt: doubling from the first wait, capped."""
    return min(settings.webhook_backoff * 2**retries, settings.webhook_backoff_max)


@app.task(name=WEBHOOK_TASK, bind=True, acks_late=True, max_retries=None)
def deliver(self: Task, url: str, event_id: str, job_id: str, created_at: int, end: str) -> str:
    """POSTs the event to `url`; tried again on a timeout, a connection error, a 5xx, 408 or 429, until
    CHATQ_WEBHOOK_RETRY_FOR seconds after the job's end. What became of it."""
    event = thin_event(event_id, job_id, created_at, end)
    if event is None:
        log.warning("webhook %s names an end that sends no event: %s", event_id, end)
        return "unknown"
    body = orjson.dumps(event).decode()
    headers = signed_headers(settings.webhook_secret.get_secret_value(), event_id, body, datetime.now(UTC))
    try:
        status = _http.post(url, content=body, headers=headers).status_code
    except httpx.TransportError as e:
        return _again(self, event_id, url, f"{type(e).__name__}: {e}", created_at)
    if 200 <= status < 300:
        log.info("webhook %s (%s of %s) delivered to %s", event_id, event["type"], job_id, url)
        return "delivered"
    if retried(status):
        return _again(self, event_id, url, f"HTTP {status}", created_at)
    log.warning("webhook %s (%s) refused by %s with HTTP %d: not sent again", event_id, event["type"], url, status)
    return "refused"


def _again(task: Task, event_id: str, url: str, why: str, created_at: int) -> str:
    """Sends the same delivery again after its backoff (Celery's retry raises), or gives up past the bound."""
    wait = backoff(task.request.retries, settings)
    if time.time() + wait > created_at + settings.webhook_retry_for:
        log.error("webhook %s to %s failed (%s); retried for CHATQ_WEBHOOK_RETRY_FOR: given up", event_id, url, why)
        return "given up"
    log.warning("webhook %s to %s failed (%s); again in %.1f s", event_id, url, why, wait)
    raise task.retry(countdown=wait)
