"""Jobs that lost their worker or their task message, queued again: the sweep every live worker makes, and a stopping
worker's hand-back. The worker that takes such a job continues it where its log stops (JobRun.resume)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis
from celery import Celery

from chatq.core import keys, logs, reclaim_scripts, telemetry
from chatq.core.errors import WorkerLost
from chatq.core.queue import lane_score, task_message
from chatq.core.settings import Settings
from chatq.core.webhooks import WebhookMessages

log = logging.getLogger(__name__)


def _requeue(app: Celery, job_id: str, lane: int, created: float, settings: Settings) -> reclaim_scripts.Requeue:
    queue, message = task_message(app, job_id, keys.celery_queue(settings.model_name), lane)
    # Where it arrived in its lane, as its task goes to the end workers take from next: it has waited once already.
    score = lane_score(lane, created)
    error = WorkerLost(settings.max_attempts).body()
    how = reclaim_scripts.Requeue(queue, message, score, settings.max_attempts, settings.result_ttl, error)
    # A job that ran out of attempts fails in the reclaim's script, which sends its webhooks then.
    if (webhooks := WebhookMessages.of(settings)) is not None:
        how.webhook = webhooks.block(job_id)
    return how


def sweep(client: redis.Redis, app: Celery, settings: Settings) -> dict[str, str]:
    """Reclaims the model's running jobs whose holder is out of the live-worker registry, and sends again the task of
    queued jobs whose message went missing; what became of each."""
    return _sweep_running(client, app, settings) | _sweep_queued(client, settings)


def _sweep_running(client: redis.Redis, app: Celery, settings: Settings) -> dict[str, str]:
    model = settings.model_name
    running: list[str] = sorted(client.smembers(keys.running(model)))  # type: ignore[arg-type]  # a decoding client
    if not running:
        return {}
    live = set(client.zrangebyscore(keys.workers(model), time.time() - settings.worker_ttl, "+inf"))  # type: ignore[arg-type]
    pipe = client.pipeline(transaction=False)
    for job_id in running:
        pipe.hmget(keys.job(job_id), "status", "worker", "lane", "created", "traceparent")
    outcomes: dict[str, str] = {}
    for job_id, (status, holder, lane, created, traceparent) in zip(running, pipe.execute(), strict=True):
        if status != "in_progress":
            if status != "queued":  # gone, or ended without its last write reaching the set
                client.srem(keys.running(model), job_id)
            continue
        if holder in live:
            continue
        how = _requeue(app, job_id, int(lane or 0), float(created or 0), settings)
        outcome = reclaim_scripts.reclaim(client, job_id, model, holder, settings.worker_ttl, how)
        if outcome is not None:
            extra = logs.job_extra(job_id, telemetry.ids(traceparent or ""))
            log.warning("job %s of worker %s, which stopped: %s", job_id, holder, outcome, extra=extra)
            outcomes[job_id] = outcome
    return outcomes


def _sweep_queued(client: redis.Redis, settings: Settings) -> dict[str, str]:
    """A queued job waiting longer than the worker TTL is checked for its task message (see
    reclaim_scripts.redeliver)."""
    queued: list[str] = client.zrange(keys.queued(settings.model_name), 0, -1)  # type: ignore[assignment]
    if not queued:
        return {}
    pipe = client.pipeline(transaction=False)
    for job_id in queued:
        pipe.hmget(keys.job(job_id), "queued_at", "tag", "task_queue", "traceparent")
    outcomes: dict[str, str] = {}
    old = time.time() - settings.worker_ttl
    for job_id, (queued_at, tag, queue, traceparent) in zip(queued, pipe.execute(), strict=True):
        if queued_at is None or float(queued_at) > old or tag is None:
            continue
        if reclaim_scripts.redeliver(client, job_id, queue, tag, settings.worker_ttl):
            extra = logs.job_extra(job_id, telemetry.ids(traceparent or ""))
            log.warning("job %s had lost its task message on the way to a worker: sent again", job_id, extra=extra)
            outcomes[job_id] = "sent again"
    return outcomes


def hand_back(client: redis.Redis, app: Celery, settings: Settings, worker: str, job_ids: Iterable[str]) -> list[str]:
    """Queues `worker`'s running jobs again, attempts uncounted, for another worker to continue; those handed back."""
    model = settings.model_name
    handed = []
    for job_id in job_ids:
        lane, created = client.hmget(keys.job(job_id), "lane", "created")  # type: ignore[misc]
        how = _requeue(app, job_id, int(lane or 0), float(created or 0), settings)
        how.queued_at = time.time() - settings.worker_ttl
        if reclaim_scripts.reclaim(client, job_id, model, worker, 0, how) == "queued":
            handed.append(job_id)
    return handed
