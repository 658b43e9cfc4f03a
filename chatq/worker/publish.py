"""Writes each engine step's output to Redis in one round trip: events, progress, finished jobs, and a read of the
cancels.

Each event goes to its job's log (a Stream with entry ids 0-<seq>) and its live channel. On a GPU a thread of its
own (Outbox) sends the writes, so the engine computes its next step while Redis takes this one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from chatq.core import keys, worker_scripts
from chatq.core.job import Event, JobStatus
from chatq.core.redis_url import sync_client
from chatq.core.replicas import ReplicaWait
from chatq.core.retry import Retry, transient
from chatq.core.settings import Settings
from chatq.core.webhooks import WebhookMessages

log = logging.getLogger(__name__)


@dataclass
class JobEnd:
    job_id: str
    status: JobStatus
    completion_tokens: int
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # what it adds to its model's metrics (JobFacts)


@dataclass
class StepWrites:
    events: list[tuple[str, Event]] = field(default_factory=list)
    progress: dict[str, int] = field(default_factory=dict)  # job id -> completion tokens so far
    ended: list[JobEnd] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.progress or self.ended)


@dataclass
class Written:
    """What Redis said of a step: the worker's jobs that clients cancelled and that had not ended by this step, and
    those it no longer holds (another worker took them over, or they were handed back)."""

    cancelled: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)


class Publisher:
    def __init__(self, client: redis.Redis, settings: Settings, worker: str):
        self.redis = step_client(settings, client)
        self.ttl = settings.result_ttl
        self.worker_ttl = settings.worker_ttl
        self.model = settings.model_name
        self.worker = worker
        self.cancels = keys.cancels(worker)
        self._refused: set[str] = set()  # event logs already reported as unwritable
        self.replicas = ReplicaWait.of(settings)
        self.webhooks = WebhookMessages.of(settings)

    def flush(self, writes: StepWrites) -> Written:
        """Sends one step's writes."""
        # MULTI/EXEC: a step's writes land together, so whoever sees a job's `done` event also sees its final record,
        # and a worker taking a job over finds the token ids of every event logged.
        pipe = self.redis.pipeline(transaction=True)
        if writes.events:
            # One script call for the step's events, whatever their number.
            # No MAXLEN: a job's log is bounded by its tokens and expires with it.
            worker_scripts.publish_events(pipe, self.worker, writes.events)
        for job_id, tokens in writes.progress.items():
            self._update(pipe, job_id, {"completion_tokens": tokens}, last=False)
        now = str(time.time())
        for end in writes.ended:
            fields: dict[str, str | bytes] = {
                "status": end.status.value,
                "finished": now,
                "completion_tokens": str(end.completion_tokens),
            }
            if end.result is not None:
                fields["result"] = orjson.dumps(end.result)
            if end.error is not None:
                fields["error"] = orjson.dumps(end.error)
            webhook = self.webhooks.block(end.job_id) if self.webhooks is not None else ""
            self._update(pipe, end.job_id, fields, last=True, metrics=end.metrics, webhook=webhook)
        if writes.ended:
            pipe.srem(self.cancels, *(end.job_id for end in writes.ended))
        # One small read whatever the number of running jobs, so every step can make it: a cancel takes effect at
        # the step after the one it arrived during.
        pipe.smembers(self.cancels)
        # Each command's error in its place, so one refused command neither hides the others' replies (the cancels)
        # nor makes the step look unwritten when the rest landed.
        results = pipe.execute(raise_on_error=False)
        errors = [r for r in results if isinstance(r, Exception)]
        for error in errors:
            if transient(error):
                raise error  # the whole step is sent again: what already landed is skipped or written the same
        if (wait := self.replicas.command()) is not None and (writes.events or writes.progress or writes.ended):
            # A master lost before its replica had the step: this fails, and the step goes again to the new one.
            self.replicas.acknowledged(self.redis.execute_command(*wait))
        if errors:
            log.error("Redis refused part of a step for good: %s", "; ".join(map(str, errors)))
        lost = self._note_refused(results[0]) if writes.events and isinstance(results[0], list) else set()
        updated = [*writes.progress, *(end.job_id for end in writes.ended)]  # in the order of their scripts' replies
        lost |= {job_id for job_id, held in zip(updated, results[bool(writes.events) :], strict=False) if held == 0}
        self._refused -= {keys.events(end.job_id) for end in writes.ended}
        cancels = results[-1]
        cancelled = set() if isinstance(cancels, Exception) else {_text(c) for c in cancels}
        return Written(cancelled, lost)

    def _update(
        self,
        pipe: redis.client.Pipeline,
        job_id: str,
        fields: dict,
        last: bool,
        metrics: dict | None = None,
        webhook: str = "",
    ) -> None:
        worker_scripts.update_record(
            pipe, self.worker, job_id, self.model, self.ttl, fields, last, metrics, webhook, self.worker_ttl
        )

    def _note_refused(self, reply: list) -> set[str]:
        """Logs the event logs newly found unwritable; the ids of the jobs this worker lost."""
        refused = {_text(k) for k in reply[0]} - self._refused
        if refused:
            log.error("event logs holding another type of value: their jobs' events are published only: %s", refused)
        self._refused |= refused
        return {_text(k).removeprefix(keys.job("")) for k in reply[1]}


def step_client(settings: Settings, shared: redis.Redis) -> redis.Redis:
    """The client a Publisher writes through: the worker's shared one, or, with replicas to wait for, one of a single
    connection of its own, on which each WAIT follows the step it waits for."""
    if not settings.wait_replicas:
        return shared
    return sync_client(settings.redis_url, blocking=True, max_connections=1, timeout=None, decode_responses=True)


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode()


class Outbox:
    """Flushes steps' writes in order, then calls `then` with what Redis said of them.

    Threaded, `put` returns at once but at most `depth` steps wait: a Redis slower than the engine slows it rather
    than let a backlog grow. Unthreaded (on a CPU), `put` writes the step itself: the forward pass uses every core, and
    GIL handoffs to another thread cost more than they save.
    """

    def __init__(self, publisher: Publisher, *, threaded: bool, depth: int = 2):
        self.publisher = publisher
        self._closing = threading.Event()
        self._retry = Retry(log, "Redis cannot take a step")
        self._queue: queue.Queue[tuple[StepWrites, Callable[[Written], None]] | None] = queue.Queue(depth)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="chatq-publish", daemon=True)
            self._thread.start()

    def put(self, writes: StepWrites, then: Callable[[Written], None]) -> None:
        if self._thread is None:
            self._write(writes, then)
        else:
            self._queue.put((writes, then))

    def close(self, timeout: float = 10) -> None:
        """Sends what is queued, then stops; a step waiting for an unreachable Redis is given up."""
        self._closing.set()
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout)
            self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._write(*item)

    def _write(self, writes: StepWrites, then: Callable[[Written], None]) -> None:
        written = Written()
        try:
            # Sent again until Redis takes it: the step's events are skipped where they were already written.
            written = self._retry.run(lambda: self.publisher.flush(writes), stop=self._closing)
        except Exception as e:
            if transient(e):
                log.error("shutting down while Redis refuses a step: its writes are lost (%s)", e)
            else:
                log.exception("writing a step to Redis failed")
        try:
            then(written)
        except Exception:
            log.exception("finishing a written step failed")
