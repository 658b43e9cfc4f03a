"""Every Redis key, channel and Celery queue name chatq uses, built in one place.

Layout (documented in the README):
  chatq:job:{id}            hash   the job record (status, request, result, progress)
  chatq:job:{id}:events     stream the replayable event log, entry ids 0-{seq}
  chatq:job:{id}:live       pubsub the same events as they happen
  chatq:job:{id}:cancel     string set when a client asks to cancel; the worker checks it every 50 ms
  chatq:queue:{model}       zset   jobs waiting for a worker of that model, for queue positions
  chatq:workers:{model}     zset   live workers of that model, scored by last heartbeat
"""

from __future__ import annotations

PREFIX = "chatq"


def job(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def events(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:events"


def live(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:live"


def cancel(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:cancel"


def waiting(model: str) -> str:
    return f"{PREFIX}:queue:{model}"


def workers(model: str) -> str:
    return f"{PREFIX}:workers:{model}"


def celery_queue(model: str) -> str:
    return f"{PREFIX}.{model}"
