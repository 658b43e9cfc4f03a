"""Running jobs whose worker is gone, queued again: the sweep every live worker makes, and a stopping worker's
hand-back. The worker that takes such a job continues it where its log stops (JobRun.resume)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis
from celery import Celery

from chatq.core import keys, scripts
from chatq.core.errors import WorkerLost
from chatq.core.queue import task_message
from chatq.core.settings import Settings

log = logging.getLogger(__name__)


def _requeue(app: Celery, job_id: str, lane: int, settings: Settings) -> scripts.Requeue:
    queue, message = task_message(app, job_id, keys.celery_queue(settings.model_name), lane)
    # Ahead of the jobs that arrived after it in its lane: it has waited once already.
    score = lane * 1e11 + time.time()
    error = WorkerLost(settings.max_attempts).body()
    return scripts.Requeue(queue, message, score, settings.max_attempts, settings.result_ttl, error)


def sweep(client: redis.Redis, app: Celery, settings: Settings) -> dict[str, str]:
    """Reclaims the model's running jobs whose holder is out of the live-worker registry; what became of each."""
    model = settings.model_name
    running: list[str] = sorted(client.smembers(keys.running(model)))  # type: ignore[arg-type]  # a decoding client
    if not running:
        return {}
    live = set(client.zrangebyscore(keys.workers(model), time.time() - settings.worker_ttl, "+inf"))  # type: ignore[arg-type]
    pipe = client.pipeline(transaction=False)
    for job_id in running:
        pipe.hmget(keys.job(job_id), "status", "worker", "lane")
    outcomes: dict[str, str] = {}
    for job_id, (status, holder, lane) in zip(running, pipe.execute(), strict=True):
        if status != "in_progress":
            if status != "queued":  # gone, or ended without its last write reaching the set
                client.srem(keys.running(model), job_id)
            continue
        if holder in live:
            continue
        how = _requeue(app, job_id, int(lane or 0), settings)
        outcome = scripts.reclaim(client, job_id, model, holder, settings.worker_ttl, how)
        if outcome is not None:
            log.warning("job %s of worker %s, which stopped: %s", job_id, holder, outcome)
            outcomes[job_id] = outcome
    return outcomes


def hand_back(client: redis.Redis, app: Celery, settings: Settings, worker: str, job_ids: Iterable[str]) -> list[str]:
    """Queues `worker`'s running jobs again, attempts uncounted, for another worker to continue; those handed back."""
    model = settings.model_name
    handed = []
    for job_id in job_ids:
        lane = client.hget(keys.job(job_id), "lane")
        how = _requeue(app, job_id, int(lane or 0), settings)  # type: ignore[arg-type]
        if scripts.reclaim(client, job_id, model, worker, 0, how) == "queued":
            handed.append(job_id)
    return handed
