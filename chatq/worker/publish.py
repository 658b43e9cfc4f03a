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

from chatq.core import keys, scripts
from chatq.core.job import Event, JobStatus
from chatq.core.retry import Retry, transient
from chatq.core.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class JobEnd:
    job_id: str
    status: JobStatus
    completion_tokens: int
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


@dataclass
class StepWrites:
    events: list[tuple[str, Event]] = field(default_factory=list)
    progress: dict[str, int] = field(default_factory=dict)  # job id -> completion tokens so far
    ended: list[JobEnd] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.progress or self.ended)


class Publisher:
    def __init__(self, client: redis.Redis, settings: Settings, worker: str):
        self.redis = client
        self.ttl = settings.result_ttl
        self.cancels = keys.cancels(worker)
        self._refused: set[str] = set()  # event logs already reported as unwritable

    def flush(self, writes: StepWrites) -> set[str]:
        """Sends one step's writes; returns the ids of the worker's jobs that clients cancelled and that had not
        ended by this step."""
        # MULTI/EXEC: a step's writes land together, so whoever sees a job's `done` event also sees its final record.
        pipe = self.redis.pipeline(transaction=True)
        if writes.events:
            # One script call, not two commands per event: packing commands dominates a step's publish cost.
            # No MAXLEN: a job's log is bounded by its tokens and expires with it.
            scripts.publish_events(pipe, writes.events)
        for job_id, tokens in writes.progress.items():
            scripts.update_record(pipe, job_id, self.ttl, {"completion_tokens": tokens}, last=False)
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
            scripts.update_record(pipe, end.job_id, self.ttl, fields, last=True)
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
        if errors:
            log.error("Redis refused part of a step for good: %s", "; ".join(map(str, errors)))
        if writes.events and isinstance(results[0], list):
            refused = set(results[0]) - self._refused
            if refused:
                log.error(
                    "event logs holding another type of value: their jobs' events are published only: %s", refused
                )
            self._refused |= refused
        self._refused -= {keys.events(end.job_id) for end in writes.ended}
        cancels = results[-1]
        return set() if isinstance(cancels, Exception) else {c if isinstance(c, str) else c.decode() for c in cancels}


class Outbox:
    """Flushes steps' writes in order, then calls `then` with the ids of jobs clients cancelled.

    Threaded, `put` returns at once but at most `depth` steps wait: a Redis slower than the engine slows it rather
    than let a backlog grow. Unthreaded (on a CPU), `put` writes the step itself: the forward pass uses every core, and
    GIL handoffs to another thread cost more than they save.
    """

    def __init__(self, publisher: Publisher, *, threaded: bool, depth: int = 2):
        self.publisher = publisher
        self._closing = threading.Event()
        self._retry = Retry(log, "Redis cannot take a step")
        self._queue: queue.Queue[tuple[StepWrites, Callable[[set[str]], None]] | None] = queue.Queue(depth)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="chatq-publish", daemon=True)
            self._thread.start()

    def put(self, writes: StepWrites, then: Callable[[set[str]], None]) -> None:
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

    def _write(self, writes: StepWrites, then: Callable[[set[str]], None]) -> None:
        cancelled: set[str] = set()
        try:
            # Sent again until Redis takes it: the step's events are skipped where they were already written.
            cancelled = self._retry.run(lambda: self.publisher.flush(writes), stop=self._closing)
        except Exception as e:
            if transient(e):
                log.error("shutting down while Redis refuses a step: its writes are lost (%s)", e)
            else:
                log.exception("writing a step to Redis failed")
        try:
            then(cancelled)
        except Exception:
            log.exception("finishing a written step failed")
