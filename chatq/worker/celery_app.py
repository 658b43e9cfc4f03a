"""The Celery worker: one process, one model, one engine; each task thread holds one job until it ends.

Run as `celery -A chatq.worker.celery_app worker -P threads` (what `chatq worker` does). The threads pool keeps a
single process, and so a single copy of the model, while many jobs run at once and share the engine's batch.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from celery import signals

from chatq.core import adapters, gc_tuning, keys, logs, lora_format, registry, telemetry, worker_scripts
from chatq.core.errors import InternalError
from chatq.core.job import Event, EventKind, Job, JobStatus
from chatq.core.model_info import ModelInfo
from chatq.core.queue import GENERATE_TASK, make_celery
from chatq.core.redis_url import sync_client
from chatq.core.settings import Settings
from chatq.worker.publish import JobEnd, Publisher, StepWrites
from chatq.worker.reclaim import hand_back, sweep
from chatq.worker.timing import JobClock
from chatq.worker.tracing import JobTrace, attempt

if TYPE_CHECKING:
    from chatq.worker.runner import Runner

log = logging.getLogger(__name__)
# The exit status of a worker whose GPU was lost (a supervisor restarts it on a fresh CUDA context).
EXIT_DEVICE_LOST = 3
settings = Settings()
logs.celery_worker(settings.log_format)
app = make_celery(settings)


@dataclass
class WorkerState:
    redis: redis.Redis
    runner: Runner
    # Celery's node name and this process' own mark: the claims record it, the registry lists it, cancels are
    # addressed to it. A worker restarted under the same node name is another holder, so the sweep reclaims the jobs
    # the dead one held.
    name: str
    # The model's registry entry (chatq.core.registry.entry), written again whenever the heartbeat finds it gone.
    entry: dict[str, str]


_state: WorkerState | None = None
_heartbeat_stop = threading.Event()


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _log_format(logger: logging.Logger, **_kwargs) -> None:
    """Celery's handlers (worker_hijack_root_logger=False leaves it setting up its own) in CHATQ_LOG_FORMAT, with the
    job's fields."""
    logs.adopt(logger, settings.log_format)


@signals.worker_init.connect
def _load(sender=None, **_kwargs) -> None:
    global _state
    from chatq.worker import metrics
    from chatq.worker.build import build_runner

    telemetry.setup("chatq-worker")
    if settings.log_format == "json":
        # transformers draws its weight-loading progress bar on stderr, ahead of Celery's redirection of it.
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    client = sync_client(settings.redis_url, decode_responses=True)
    name = f"{getattr(sender, 'hostname', 'worker')}#{uuid.uuid4().hex[:8]}"
    runner = build_runner(settings, client, name)
    runner.on_device_lost = _device_lost
    metrics.serve(runner, settings)  # before the model loads, so a scraper sees the worker start
    runner.start()
    entry = registry.entry(runner.model)
    registry.register(client, entry)
    _announce_adapters(client, runner.model)
    _state = WorkerState(client, runner, name, entry)


def _announce_adapters(client: redis.Redis, model: ModelInfo) -> None:
    """Makes CHATQ_LORA_MODULES' adapters known, each checked against the model first: a bad one stops the worker's
    start, as it stops vLLM's."""
    for name, path in adapters.parse_modules(settings.lora_modules).items():
        config = lora_format.check(path, model.lora, model.name)
        adapters.add_at_start(client, adapters.record(name, model.name, path, config))


@signals.worker_ready.connect
def _ready(sender=None, **_kwargs) -> None:
    assert _state is not None
    gc_tuning.settle()
    threading.Thread(target=_heartbeat, args=(_state,), name="chatq-heartbeat", daemon=True).start()


@signals.worker_shutdown.connect
def _shutdown(**_kwargs) -> None:
    _heartbeat_stop.set()
    if _state is not None:
        _state.redis.zrem(keys.workers(settings.model_name), _state.name)
        _state.redis.delete(keys.worker(_state.name))
        _state.runner.stop()
    telemetry.shutdown()
    # Frozen objects are never freed, and Triton's bindings list each one they still own at exit.
    gc.unfreeze()


@signals.worker_shutting_down.connect
def _stopping(**_kwargs) -> None:
    """The first SIGTERM (or SIGINT): Celery takes no new jobs and waits for the running ones, which get
    `stop_grace` seconds before they are handed to other workers. A second signal hands them over at once and
    exits."""
    threading.Thread(target=_hand_back_after, args=(settings.stop_grace,), name="chatq-grace", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_now)


def _hand_back_after(grace: float) -> None:
    if not _heartbeat_stop.wait(grace):
        _hand_back_all()


def _stop_now(*_args) -> None:
    _hand_back_all()
    if _state is not None:
        _state.redis.zrem(keys.workers(settings.model_name), _state.name)
    os._exit(1)


def _device_lost() -> None:
    """The engine's GPU failed for good (chatq.worker.device): out of the live-worker registry at once, so the next
    sweep of any other worker takes this one's jobs, each to continue there as after a SIGKILL (the attempt counts),
    and the process exits for its supervisor to restart it. Not swept from here: this process' Celery consumer
    would take a job back before the exit."""
    _heartbeat_stop.set()
    if _state is not None:
        held = ", ".join(_state.runner.runs) or "none"
        log.critical("leaving this worker's jobs to the others' sweep: %s", held)
        try:
            _state.redis.zrem(keys.workers(settings.model_name), _state.name)
            _state.redis.delete(keys.worker(_state.name))
        except redis.RedisError:
            log.exception("leaving the live-worker registry failed: this worker counts as dead a worker TTL from now")
    os._exit(EXIT_DEVICE_LOST)


def _hand_back_all() -> None:
    if _state is None:
        return
    running = list(_state.runner.runs)
    handed = hand_back(_state.redis, app, settings, _state.name, running)
    if handed:
        log.warning("handed %d running jobs to other workers: %s", len(handed), ", ".join(handed))
    _state.runner.release(handed)


def _heartbeat(state: WorkerState) -> None:
    while not _heartbeat_stop.is_set():
        if beat(state, settings) is None:
            try:
                sweep(state.redis, app, settings)
            except redis.RedisError:
                log.warning("sweeping for jobs of stopped workers failed", exc_info=True)
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
            pipe.delete(keys.worker(state.name))
        else:
            pipe.zadd(key, {state.name: now})
            pipe.hset(keys.worker(state.name), mapping=_worker_entry(state, settings))  # type: ignore[arg-type]
            pipe.expire(keys.worker(state.name), settings.worker_ttl)
        pipe.zremrangebyscore(key, 0, now - settings.worker_ttl)
        pipe.hget(keys.model(settings.model_name), "digest")
        digest = pipe.execute()[-1]
        if digest != state.entry["digest"]:
            # Redis lost its data, or a worker of other files under this name took the entry over: the API must
            # render with the files this worker generates with.
            if digest is not None:
                log.warning("workers of model %s disagree on its files: each registers its own", settings.model_name)
            registry.register(state.redis, state.entry)
    except redis.RedisError:
        log.warning("heartbeat failed", exc_info=True)
    if stalled:
        log.error("out of the live-worker registry until the engine moves again: %s", stalled)
    return stalled


def _worker_entry(state: WorkerState, settings: Settings) -> dict[str, str]:
    """This worker's own registry entry (keys.worker): its model, device, how its engine runs, its slots."""
    engine = state.runner.engine
    checks = json.dumps([str(c) for c in engine.checks])
    entry = {"model": settings.model_name, "device": str(engine.device), "mode": engine.mode, "checks": checks}
    return entry | {"slots": str(settings.worker_concurrency)}  # the jobs it runs at once: its fair-share slots


@app.task(name=GENERATE_TASK, bind=True)
def generate(self, job_id: str) -> str:
    assert _state is not None, "worker_init did not run"
    properties = self.request.properties or {}
    lane, delivery = properties.get("priority") or 0, properties.get("delivery_tag") or ""
    record = worker_scripts.claim(_state.redis, job_id, settings.model_name, _state.name, lane, delivery)
    if not record:  # cancelled while queued, expired, or already held by another worker
        return "skipped"
    with attempt(record, settings.model_name) as spans:
        return _run(_state, job_id, record, spans)


def _run(state: WorkerState, job_id: str, record: dict[str, str], spans: JobTrace) -> str:
    """Runs the claimed job to its end (or hand-over); its status."""
    if (stale := state.runner.holds(job_id)) is not None:
        # Reclaimed from this very worker while it was counted out (a stalled step): the run it still had goes,
        # and the new one continues from the log.
        state.runner.release([job_id])
        stale.done.wait()
    try:
        job = Job.from_redis(record)
    except (ValueError, KeyError) as e:  # written by another version of chatq, say: the job ends, not hangs
        # Its type only: the error's text quotes the record, and so the request.
        log.error("job %s has a record this worker cannot read (%s)", job_id, type(e).__name__)
        _fail_unreadable(
            state, job_id, InternalError(f"This worker cannot read the job's record ({type(e).__name__}).")
        )
        return JobStatus.failed.value
    # A log means an earlier attempt (a worker that died or handed the job back): this one goes on from it.
    earlier = _read_log(state.redis, job_id) or None
    run = state.runner.submit(job, earlier, JobClock.from_record(record, resumed=earlier is not None))
    run.done.wait()
    spans.finish(run)
    return run.status.value if run.status else "handed over"


def _read_log(client: redis.Redis, job_id: str) -> list[Event]:
    """What the job's earlier attempts published, for this one to continue from."""
    return [Event.from_json(fields["msg"]) for _, fields in client.xrange(keys.events(job_id))]  # type: ignore[union-attr,index]


def _fail_unreadable(state: WorkerState, job_id: str, error: InternalError) -> None:
    body = error.body()
    events = [Event(seq=1, event=EventKind.error, data=body), Event(seq=2, event=EventKind.done)]
    writes = StepWrites(
        events=[(job_id, e) for e in events], ended=[JobEnd(job_id, JobStatus.failed, 0, error=body["error"])]
    )
    Publisher(state.redis, settings, state.name).flush(writes)
