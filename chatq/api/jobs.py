"""Job records in Redis, as the API sees them: submit, read, cancel, delete."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import redis.asyncio as aioredis
from celery import Celery
from pydantic_core import PydanticSerializationError

from chatq.api.relay import last_seq
from chatq.core import api_scripts, keys, logs, telemetry
from chatq.core.adapters import Adapter
from chatq.core.api_scripts import InFlight, Listing, Outcome, Parking
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.chunks import cancelled_while_queued
from chatq.core.completion_request import CompletionRequest
from chatq.core.errors import BadRequest, Conflict, InFlightFull, JobNotFound, QueueFull
from chatq.core.fair import Share
from chatq.core.job import Event, EventKind, Job, JobStatus, cache_partition
from chatq.core.queue import BATCH_LANE, celery_priority, lane_score, task_fields, task_message
from chatq.core.replicas import ReplicaWait
from chatq.core.settings import Settings
from chatq.core.webhooks import WebhookMessages

log = logging.getLogger(__name__)

# Seconds a client refused for a full queue is told to wait: about a short generation's time.
QUEUE_FULL_RETRY_AFTER = 5
# Jobs an owner's list keeps, its newest: the oldest leave it (they stay readable by id until they expire).
LISTED_JOBS = 1000
# Ids read from an owner's list at a time while a page is gathered.
LIST_BATCH = 100


@dataclass(frozen=True)
class Page:
    """Which of an owner's jobs a list shows: at most `limit`, after the job `after`, in creation order or newest
    first (`desc`), of one model or all."""

    limit: int = 20
    after: str | None = None
    desc: bool = False
    model: str | None = None


@dataclass(frozen=True)
class JobList:
    jobs: list[Job]
    has_more: bool


class Submission(NamedTuple):
    job: Job
    position: int | None  # in the queue when submitted; None for an existing job (read when shown)
    created: bool  # False: an idempotency key named this job, created by an earlier request


# Ids are part of Redis key names, so they must not hold the names' separator: the record of a job "abc:events"
# would be the event log of job "abc".
JOB_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


# A job's id starts with its kind's prefix, as OpenAI's ids do.
ID_PREFIX = {"chat": "chatcmpl-", "text": "cmpl-", "response": "resp_"}


class JobStore:
    def __init__(self, client: aioredis.Redis, celery: Celery, settings: Settings):
        self.redis = client
        self.celery = celery
        self.settings = settings
        self._detached: set[asyncio.Task[None]] = set()
        self.replicas = ReplicaWait.of(settings)
        self.webhooks = WebhookMessages.of(settings)

    async def submit(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        kind: Literal["chat", "text", "response"],
        model: str,
        prompts: list[list[int]],
        request_id: str | None,
        owner: str = "",
        idempotency_key: str | None = None,
        trace: Mapping[str, str] = {},  # noqa: B006  (read only)
        response: dict[str, Any] | None = None,
        line: bool = False,
        in_flight: int | None = None,
        share: Share | None = None,
        adapter: Adapter | None = None,
    ) -> Submission:
        """The job, recorded and enqueued, and its queue position at that moment; or the live job that
        `idempotency_key` already names for this owner, with nothing enqueued. `prompts`: the prompt's ids, or each
        of a legacy batch's. `trace` is the trace context the job keeps (telemetry.job_trace). A batch's `line` goes
        in the batch lane, unlisted and uncapped. `in_flight`: the owner's cap on its jobs queued or running. `share`:
        what the job counts for in its owner's fair share; with it (and CHATQ_FAIR_SHARE), the job waits for a free
        slot there rather than going to its lane at once (chatq.core.fair). `adapter`: the LoRA adapter it runs with."""
        if request_id is not None and not JOB_ID.fullmatch(request_id):
            raise BadRequest("request_id must be 1 to 128 letters, digits or the characters . _ ~ -", "request_id")
        job = self._job(request, kind, model, prompts, request_id, owner, trace, response)
        job.adapter = adapter
        lane = BATCH_LANE if line else celery_priority(request.priority, request.background)
        now = time.time()
        score = lane_score(lane, now)
        queue, message = task_message(self.celery, job.id, keys.celery_queue(model), lane)
        # `submitted`: where the job's latency metrics start (chatq.core.metrics); `created` has whole seconds.
        fields = self._record(job, owner) | task_fields(queue, message, now) | {"submitted": repr(now)}
        parking = self._parking(owner, lane, share) if not line else None
        if parking is not None and share is not None:
            fields |= {"cost": repr(share.cost), "weight": repr(share.weight)}
        idem = keys.idempotency(owner, idempotency_key) if idempotency_key is not None else None
        listing = None if line else Listing(keys.owner_jobs(owner), LISTED_JOBS, self.settings.result_ttl)
        cap = 0 if line else self.settings.max_queued
        flight = InFlight(keys.in_flight(owner), in_flight, self.settings.result_ttl) if in_flight else None
        done = await self._submit(job.id, model, fields, queue, message, score, idem, listing, cap, flight, parking)
        if done.outcome is Outcome.existing:
            return Submission(await self._named(done.job_id, owner, kind, idempotency_key), None, created=False)
        if done.outcome is Outcome.full:
            raise QueueFull(model, QUEUE_FULL_RETRY_AFTER)
        if done.outcome is Outcome.busy:
            raise InFlightFull(in_flight or 0)
        if done.outcome is Outcome.taken or done.rank is None:
            raise Conflict(f"A job with id '{job.id}' already exists; request ids must be unique.", "request_id")
        logs.bind(job.id, telemetry.ids(job.traceparent))
        # The job's one line in the API's log: what ties a request to the worker's lines about its job.
        log.info("job %s queued for %s at position %d", job.id, model, done.rank + 1)
        return Submission(job, done.rank + 1, created=True)

    def _job(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        kind: Literal["chat", "text", "response"],
        model: str,
        prompts: list[list[int]],
        request_id: str | None,
        owner: str,
        trace: Mapping[str, str],
        response: dict[str, Any] | None,
    ) -> Job:
        return Job(
            id=ID_PREFIX[kind] + (request_id or uuid.uuid4().hex),
            model=model,
            kind=kind,
            request=request,
            prompt_ids=prompts[0],
            batch=prompts if len(prompts) > 1 else [],
            traceparent=trace.get("traceparent", ""),
            tracestate=trace.get("tracestate", ""),
            response=response,
            cache_partition=cache_partition(owner, request.cache_salt, self.settings.share_prefix_cache),
        )

    def _parking(self, owner: str, lane: int, share: Share | None) -> Parking | None:
        """Where the job waits for its owner's fair share, if it does."""
        return Parking(owner, lane, self.settings.worker_ttl) if share and self.settings.fair_share else None

    async def _named(self, job_id: str, owner: str, kind: str, idempotency_key: str | None) -> Job:
        """The job an Idempotency-Key named, if this route can show it: chat and legacy completions show each other's
        jobs, the Responses API only its own."""
        job = await self.get(job_id, owner)
        if (job.kind == "response") != (kind == "response"):
            what = "a response" if job.kind == "response" else "a completion"
            raise Conflict(
                f"Idempotency-Key {idempotency_key!r} already names {what} ({job.id}), which this route does not "
                "serve; use another key.",
                "Idempotency-Key",
            )
        return job

    async def _submit(
        self,
        job_id: str,
        model: str,
        fields: dict[str, str],
        queue: str,
        message: str,
        score: float,
        idem: str | None,
        listing: Listing | None,
        cap: int,
        in_flight: InFlight | None,
        parking: Parking | None,
    ) -> api_scripts.Submitted:
        """api_scripts.submit, then, with replicas to wait for, their WAIT on the same connection (it waits only for
        that connection's writes): a job this API accepted is on a replica, so a failover keeps it."""
        args = (job_id, model, fields, queue, message, score, cap, idem, listing, in_flight, parking)
        if (wait := self.replicas.command()) is None:
            return await api_scripts.submit(self.redis, *args)
        async with self.redis.client() as pinned:
            done = await api_scripts.submit(pinned, *args)
            self.replicas.acknowledged(await pinned.execute_command(*wait))
        return done

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
        """The job's record; another owner's job is not found, exactly as one that does not exist. The request's log
        lines name the job from here on."""
        self._check(job_id)
        h: dict[str, str] = await self.redis.hgetall(keys.job(job_id))  # type: ignore[assignment]  # a decoding client
        if not h or "deleted" in h:  # a deleted job whose run is still stopping
            raise JobNotFound(job_id)
        if owner is not None and not hmac.compare_digest(h.get("owner", ""), owner):
            raise JobNotFound(job_id)
        logs.bind(job_id, telemetry.ids(h.get("traceparent", "")))
        return h

    async def cancel(self, job_id: str, delete: bool = False, owner: str | None = None) -> None:
        """Cancels the job if it has not ended; `delete` also removes it (see chatq.core.api_scripts.cancel). Only
        `owner`'s job is cancelled (None: any)."""
        h = await self._visible(job_id, owner) if owner is not None else await self._record_of(job_id)
        # What a queued job's stream closes with, should the job still be queued when the script runs; after the
        # events of an earlier attempt, when a worker stopped while running it.
        chunks, logged = [], 0
        if h.get("status") == JobStatus.queued:
            logged = await last_seq(self.redis, job_id) or 0  # a log it cannot read: still cancelled
            with contextlib.suppress(ValueError, KeyError):  # a record this version cannot read is still cancelled
                chunks = cancelled_while_queued(Job.from_redis(h), opened=logged > 0)[0]
        events = [Event(seq=i, event=EventKind.chunk, data=c) for i, c in enumerate(chunks, logged + 1)]
        events.append(Event(seq=logged + len(events) + 1, event=EventKind.done))
        # Sent only if the script finds the job queued (a running one's worker sends its own at its end); built
        # whatever the status read above, which a reclaim may have turned back to queued since.
        webhook = self.webhooks.block(job_id) if self.webhooks is not None and not delete else ""
        if await api_scripts.cancel(self.redis, job_id, self.settings.result_ttl, delete, events, webhook) is None:
            raise JobNotFound(job_id)

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

    async def list_jobs(self, owner: str, page: Page) -> JobList:
        """A page of the owner's jobs, newest first if `page.desc`; the ids of jobs that expired meanwhile (or whose
        id another owner's job took since) leave the owner's list."""
        key = keys.owner_jobs(owner)
        start = await self._page_start(key, page)
        jobs: list[Job] = []
        gone: list[str] = []
        while len(jobs) <= page.limit:
            ids: list[str] = await self.redis.zrange(  # type: ignore[assignment]  # a decoding client's ids
                key, start, start + LIST_BATCH - 1, desc=page.desc
            )
            if not ids:
                break
            start += len(ids)
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hgetall(keys.job(job_id))
                records: list[dict[str, str]] = await pipe.execute()
            for job_id, h in zip(ids, records, strict=True):
                job = self._listed(h, owner, page.model)
                if job is not None:
                    jobs.append(job)
                elif not h or h.get("owner", "") != owner:
                    gone.append(job_id)
        if gone:
            await self.redis.zrem(key, *gone)
        return JobList(jobs[: page.limit], has_more=len(jobs) > page.limit)

    async def _page_start(self, key: str, page: Page) -> int:
        """The rank in the owner's list (in the page's order) that the page starts at: just past `page.after`."""
        if page.after is None:
            return 0
        read = self.redis.zrevrank if page.desc else self.redis.zrank
        rank: int | None = await read(key, page.after)  # type: ignore[assignment]  # a rank or None
        if rank is None:
            raise JobNotFound(page.after, "after")
        return rank + 1

    @staticmethod
    def _listed(h: dict[str, str], owner: str, model: str | None) -> Job | None:
        """The job of a record read for the owner's list, if the page shows it."""
        # Responses are listed by no route (OpenAI has none), not among chat completions.
        if not h or "deleted" in h or h.get("owner", "") != owner or h.get("kind") == "response":
            return None
        try:
            job = Job.from_redis(h)
        except (ValueError, KeyError):  # a record this version cannot read: left out, as GET would fail on it
            return None
        return job if model is None or job.shown_model == model else None

    async def queue_position(self, job: Job) -> int | None:
        rank: int | None = await self.redis.zrank(keys.queued(job.model), job.id)  # type: ignore[assignment]
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
            obj = cancelled_while_queued(job)[1]
        else:
            obj = {
                "id": job.id,
                "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": job.created,
                "model": job.shown_model,
                "choices": [],
            }
        obj["status"] = job.status.value
        progress: dict[str, Any] = {
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
        }
        if job.status is JobStatus.queued:
            progress["queue_position"] = queue_position or await self.queue_position(job)
        obj["progress"] = progress
        if job.error:
            obj["error"] = job.error
        return obj
