"""Job records in Redis, as the API sees them: submit, read, cancel, delete."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from typing import Any, Literal

import redis.asyncio as aioredis
from celery import Celery
from pydantic_core import PydanticSerializationError

from chatq.core import keys, scripts
from chatq.core.chunks import never_ran
from chatq.core.errors import BadRequest, Conflict, JobNotFound
from chatq.core.job import Event, EventKind, Job, JobStatus
from chatq.core.queue import celery_priority, task_message
from chatq.core.requests import ChatCompletionRequest, CompletionRequest
from chatq.core.settings import Settings

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
    ) -> tuple[Job, int]:
        """The job, recorded and enqueued, and its queue position at that moment."""
        if request_id is not None and not JOB_ID.fullmatch(request_id):
            raise BadRequest("request_id must be 1 to 128 letters, digits or the characters . _ ~ -", "request_id")
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        job = Job(
            id=prefix + (request_id or uuid.uuid4().hex), model=model, kind=kind, request=request, prompt_ids=prompt_ids
        )
        lane = celery_priority(request.priority)
        # Scored by lane, then arrival, so a rank in this set is the job's place in the worker's pick order.
        score = lane * 1e11 + time.time()
        try:
            fields = job.to_redis()
        except PydanticSerializationError as e:  # nesting beyond what the serializer follows
            raise BadRequest(f"The request cannot be stored: {e}", None) from e
        queue, message = task_message(self.celery, job.id, keys.celery_queue(model), lane)
        rank = await scripts.submit(self.redis, job.id, model, fields, queue, message, score)
        if rank is None:
            raise Conflict(f"A job with id '{job.id}' already exists; request ids must be unique.", "request_id")
        return job, rank + 1

    async def get(self, job_id: str) -> Job:
        self._check(job_id)
        h: dict[str, str] = await self.redis.hgetall(keys.job(job_id))  # type: ignore[assignment]  # a decoding client
        if not h or "deleted" in h:  # a deleted job whose run is still stopping
            raise JobNotFound(job_id)
        return Job.from_redis(h)

    async def cancel(self, job_id: str, delete: bool = False) -> None:
        """Cancels the job if it has not ended; `delete` also removes it (see chatq.core.scripts.cancel)."""
        self._check(job_id)
        h: dict[str, str] = await self.redis.hgetall(keys.job(job_id))  # type: ignore[assignment]  # a decoding client
        # What a queued job's stream closes with, should the job still be queued when the script runs; after the
        # events of an earlier attempt, when a worker stopped while running it.
        chunks, logged = [], 0
        if h.get("status") == JobStatus.queued:
            logged = await self._last_logged(job_id) if h.get("attempts", "0") != "0" else 0
            with contextlib.suppress(ValueError, KeyError):  # a record this version cannot read is still cancelled
                chunks = never_ran(Job.from_redis(h), opened=logged > 0)[0]
        events = [Event(seq=i, event=EventKind.chunk, data=c) for i, c in enumerate(chunks, logged + 1)]
        events.append(Event(seq=logged + len(events) + 1, event=EventKind.done))
        if await scripts.cancel(self.redis, job_id, self.settings.result_ttl, delete, events) is None:
            raise JobNotFound(job_id)

    async def _last_logged(self, job_id: str) -> int:
        last: list[tuple[str, dict[str, str]]] = await self.redis.xrevrange(  # type: ignore[assignment]
            keys.events(job_id), count=1
        )
        return int(last[0][0].split("-")[1]) if last else 0

    def cancel_soon(self, job_id: str) -> None:
        """Cancels the job in a task of its own: for a request whose client went away, whose own task is being
        cancelled."""
        task = asyncio.create_task(self.cancel(job_id))
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def delete(self, job_id: str) -> None:
        await self.cancel(job_id, delete=True)

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
