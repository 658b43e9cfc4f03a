"""The Celery worker: one process, one model, one engine; each task thread holds one job until it ends.

Run as `celery -A chatq.worker.celery_app worker -P threads` (what `chatq worker` does). The threads pool keeps a
single process, and so a single copy of the model, while many jobs run at once and share the engine's batch.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from celery import signals

from chatq.core import collector, keys, scripts
from chatq.core.errors import InternalError
from chatq.core.job import Event, EventKind, Job, JobStatus
from chatq.core.queue import GENERATE_TASK, make_celery
from chatq.core.settings import Settings
from chatq.worker.publish import JobEnd, Publisher, StepWrites

if TYPE_CHECKING:
    from chatq.worker.runner import Runner

log = logging.getLogger(__name__)
# Celery's two INFO lines per job ("received", "succeeded") cost CPU on every job and repeat what the job record and
# Flower show; failures still log at ERROR.
for name in ("celery.app.trace", "celery.worker.strategy"):
    logging.getLogger(name).setLevel(logging.WARNING)

settings = Settings()
app = make_celery(settings)


@dataclass
class WorkerState:
    redis: redis.Redis
    runner: Runner
    name: str  # Celery's node name: the claims record it, the registry lists it, cancels are addressed to it


_state: WorkerState | None = None
_heartbeat_stop = threading.Event()


@signals.worker_init.connect
def _load(sender=None, **_kwargs) -> None:
    global _state
    from chatq.worker.build import build_runner

    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    name = getattr(sender, "hostname", "worker")
    runner = build_runner(settings, client, name)
    runner.start()
    _state = WorkerState(client, runner, name)


@signals.worker_ready.connect
def _ready(sender=None, **_kwargs) -> None:
    assert _state is not None
    collector.settle()
    threading.Thread(target=_heartbeat, args=(_state,), name="chatq-heartbeat", daemon=True).start()


@signals.worker_shutdown.connect
def _shutdown(**_kwargs) -> None:
    _heartbeat_stop.set()
    if _state is not None:
        _state.redis.zrem(keys.workers(settings.model_name), _state.name)
        _state.runner.stop()
    # Frozen objects are never freed, and Triton's bindings list each one they still own at exit.
    gc.unfreeze()


def _heartbeat(state: WorkerState) -> None:
    while not _heartbeat_stop.is_set():
        beat(state, settings)
        _heartbeat_stop.wait(settings.worker_ttl / 3)


def beat(state: WorkerState, settings: Settings) -> str | None:
    """Keeps this worker in the model's live-worker registry, which /health and schedulers read, while its engine
    makes progress: a process that is up around a hung engine serves no one. Returns what stalled it, if anything."""
    key = keys.workers(settings.model_name)
    stalled = state.runner.stalled(settings.step_timeout)
    try:
        now = time.time()
        pipe = state.redis.pipeline(transaction=False)
        if stalled:
            pipe.zrem(key, state.name)
        else:
            pipe.zadd(key, {state.name: now})
        pipe.zremrangebyscore(key, 0, now - settings.worker_ttl)
        pipe.execute()
    except redis.RedisError:
        log.warning("heartbeat failed", exc_info=True)
    if stalled:
        log.error("out of the live-worker registry until the engine moves again: %s", stalled)
    return stalled


@app.task(name=GENERATE_TASK)
def generate(job_id: str) -> str:
    assert _state is not None, "worker_init did not run"
    record = scripts.claim(_state.redis, job_id, settings.model_name, _state.name)
    if not record:  # cancelled while queued, expired, or already held by another worker
        return "skipped"
    try:
        job = Job.from_redis(record)
    except (ValueError, KeyError) as e:  # written by another version of chatq, say: the job ends, not hangs
        log.exception("job %s has a record this worker cannot read", job_id)
        _fail_unreadable(
            _state, job_id, InternalError(f"This worker cannot read the job's record ({type(e).__name__}).")
        )
        return JobStatus.failed.value
    run = _state.runner.submit(job)
    run.done.wait()
    return run.status.value if run.status else "unknown"


def _fail_unreadable(state: WorkerState, job_id: str, error: InternalError) -> None:
    body = error.body()
    events = [Event(seq=1, event=EventKind.error, data=body), Event(seq=2, event=EventKind.done)]
    writes = StepWrites(
        events=[(job_id, e) for e in events], ended=[JobEnd(job_id, JobStatus.failed, 0, error=body["error"])]
    )
    Publisher(state.redis, settings, state.name).flush(writes)
