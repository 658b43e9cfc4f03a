"""Job records in Redis, as the API sees them: submit, read, cancel, delete."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import time
import uuid
from typing import Any, Literal, NamedTuple

import redis.asyncio as aioredis
from celery import Celery
from pydantic_core import PydanticSerializationError

from chatq.core import keys, scripts
from chatq.core.chunks import never_ran
from chatq.core.errors import BadRequest, Conflict, JobNotFound, QueueFull
from chatq.core.job import Event, EventKind, Job, JobStatus
from chatq.core.queue import celery_priority, task_fields, task_message
from chatq.core.requests import ChatCompletionRequest, CompletionRequest
from chatq.core.scripts import Outcome
from chatq.core.settings import Settings

# Seconds a client refused for a full queue is told to wait: about a short generation's time.
QUEUE_FULL_RETRY_AFTER = 5


class Submission(NamedTuple):
    job: Job
    position: int | None  # in the queue when submitted; None for an existing job (read when shown)
    created: bool  # False: an idempotency key named this job, created by an earlier request


# Ids are part of Redis key names, so they must not hold the names' separator: the record of a job "abc:events"
# would be the event log of job "abc".
JOB_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


class JobStore:
    def __init__(self, client: aioredis.Redis, celery: Celery, settings: Settings):
        self.redis = client
        self.celery = celery
        self.settings = settings
        self._detached: set[asyncio.Task[None]] = set()

    async def submit(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        kind: Literal["chat", "text"],
        model: str,
        prompt_ids: list[int],
        request_id: str | None,
        owner: str = "",
        idempotency_key: str | None = None,
    ) -> Submission:
        """The job, recorded and enqueued, and its queue position at that moment; or the live job that
        `idempotency_key` already names for this owner, with nothing enqueued."""
        if request_id is not None and not JOB_ID.fullmatch(request_id):
            raise BadRequest("request_id must be 1 to 128 letters, digits or the characters . _ ~ -", "request_id")
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        job = Job(
            id=prefix + (request_id or uuid.uuid4().hex), model=model, kind=kind, request=request, prompt_ids=prompt_ids
        )
        lane, now = celery_priority(request.priority, request.background), time.time()
        # Scored by lane, then arrival, so a rank in this set is the job's place in the worker's pick order.
        score = lane * 1e11 + now
        queue, message = task_message(self.celery, job.id, keys.celery_queue(model), lane)
        # `submitted`: where the job's latency metrics start (chatq.core.metrics); `created` has whole seconds.
        fields = self._record(job, owner) | task_fields(queue, message, now) | {"submitted": repr(now)}
        idem = keys.idempotency(owner, idempotency_key) if idempotency_key is not None else None
        done = await scripts.submit(
            self.redis, job.id, model, fields, queue, message, score, self.settings.max_queued, idem
        )
        if done.outcome is Outcome.existing:
            return Submission(await self.get(done.job_id, owner), None, created=False)
        if done.outcome is Outcome.full:
            raise QueueFull(model, QUEUE_FULL_RETRY_AFTER)
        if done.outcome is Outcome.taken or done.rank is None:
            raise Conflict(f"A job with id '{job.id}' already exists; request ids must be unique.", "request_id")
        return Submission(job, done.rank + 1, created=True)

    @staticmethod
    def _record(job: Job, owner: str) -> dict[str, str]:
        """The job's record, with its owner: a hash of the API key that created it, never the key."""
        try:
            fields = job.to_redis()
        except PydanticSerializationError as e:  # nesting beyond what the serializer follows
            raise BadRequest(f"The request cannot be stored: {e}", None) from e
        return fields | {"owner": owner} if owner else fields

    async def get(self, job_id: str, owner: str | None = None) -> Job:
        """The job, if `owner` may see it (None: anyone, for the API's own reads)."""
        return Job.from_redis(await self._visible(job_id, owner))

    async def _visible(self, job_id: str, owner: str | None) -> dict[str, str]:
        """The job's record; another owner's job is not found, exactly as one that does not exist."""
        self._check(job_id)
        h: dict[str, str] = await self.redis.hgetall(keys.job(job_id))  # type: ignore[assignment]  # a decoding client
        if not h or "deleted" in h:  # a deleted job whose run is still stopping
            raise JobNotFound(job_id)
        if owner is not None and not hmac.compare_digest(h.get("owner", ""), owner):
            raise JobNotFound(job_id)
        return h

    async def cancel(self, job_id: str, delete: bool = False, owner: str | None = None) -> None:
        """Cancels the job if it has not ended; `delete` also removes it (see chatq.core.scripts.cancel). Only
        `owner`'s job is cancelled (None: any)."""
        h = await self._visible(job_id, owner) if owner is not None else await self._record_of(job_id)
        # What a queued job's stream closes with, should the job still be queued when the script runs; after the
        # events of an earlier attempt, when a worker stopped while running it.
        chunks, logged = [], 0
        if h.get("status") == JobStatus.queued:
            logged = await self._last_logged(job_id)
            with contextlib.suppress(ValueError, KeyError):  # a record this version cannot read is still cancelled
                chunks = never_ran(Job.from_redis(h), opened=logged > 0)[0]
        events = [Event(seq=i, event=EventKind.chunk, data=c) for i, c in enumerate(chunks, logged + 1)]
        events.append(Event(seq=logged + len(events) + 1, event=EventKind.done))
        if await scripts.cancel(self.redis, job_id, self.settings.result_ttl, delete, events) is None:
            raise JobNotFound(job_id)

    async def _last_logged(self, job_id: str) -> int:
        """The number of the job's last logged event; 0 for none, or for a log that holds another type of value (the
        cancel still goes through)."""
        try:
            last: list[tuple[str, dict[str, str]]] = await self.redis.xrevrange(  # type: ignore[assignment]
                keys.events(job_id), count=1
            )
        except aioredis.ResponseError:
            return 0
        return int(last[0][0].split("-")[1]) if last else 0

    def cancel_soon(self, job_id: str) -> None:
        """Cancels the job in a task of its own: for a request whose client went away, whose own task is being
        cancelled."""
        task = asyncio.create_task(self.cancel(job_id))
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _record_of(self, job_id: str) -> dict[str, str]:
        self._check(job_id)
        return await self.redis.hgetall(keys.job(job_id))  # type: ignore[return-value,misc]  # a decoding client

    async def delete(self, job_id: str, owner: str | None = None) -> None:
        await self.cancel(job_id, delete=True, owner=owner)

    async def queue_position(self, job: Job) -> int | None:
        rank: int | None = await self.redis.zrank(keys.waiting(job.model), job.id)  # type: ignore[assignment]
        return None if rank is None else rank + 1

    @staticmethod
    def _check(job_id: str) -> None:
        if not JOB_ID.fullmatch(job_id):
            raise JobNotFound(job_id)

    async def view(self, job: Job, queue_position: int | None = None) -> dict[str, Any]:
        """The job as a chat.completion object with its status, as GET returns it; a queued job's position is read
        unless given."""
        obj: dict[str, Any]
        if job.result:
            obj = dict(job.result)
        elif job.status is JobStatus.cancelled:
            obj = never_ran(job)[1]
        else:
            obj = {
                "id": job.id,
                "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": job.created,
                "model": job.model,
                "choices": [],
            }
        obj["status"] = job.status.value
        progress: dict[str, Any] = {
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": job.completion_tokens,
        }
        if job.status is JobStatus.queued:
            progress["queue_position"] = queue_position or await self.queue_position(job)
        obj["progress"] = progress
        if job.error:
            obj["error"] = job.error
        return obj
