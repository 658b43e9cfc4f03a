"""The batch runner every API process runs: each batch in progress is run by one API at a time (its lease in Redis),
which releases the batch's lines into its model's batch lane as workers have room, answers each line once as its job
ends, and ends the batch: its output and error files written, then `completed`, `cancelled` or `expired`.

An API that stops leaves its batches' leases to run out; another API (or itself, restarted) takes them over and goes
on from what Redis holds (chatq.core.batch_run).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal, TypeVar

from chatq.api import responses
from chatq.api.batch_files import BatchFiles
from chatq.api.jobs import ID_PREFIX
from chatq.api.routes import Service
from chatq.core import batch_run, batches, keys
from chatq.core.batch_run import Answer, PlanLine
from chatq.core.batches import Batch
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.errors import ChatqError, Conflict, ModelNotFound
from chatq.core.filestore import StoredFileMissing
from chatq.core.job import Job, JobStatus
from chatq.core.lua import Script
from chatq.core.priority import BATCH_ENGINE_PRIORITY
from chatq.core.responses_request import ResponsesRequest

log = logging.getLogger(__name__)

# Seconds a runner's lease on a batch lasts unless renewed: how long a batch waits after its API stopped.
LEASE = 10.0
# Seconds between looks for batches no API runs.
LOOK_EVERY = 1.0
# Seconds lines cancelled at a batch's end may take to stop before they are reported unanswered all the same.
STOP_GRACE = 30.0
# Plan lines read per thread hop.
READ_AHEAD = 256
KINDS: dict[str, Literal["chat", "text", "response"]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text",
    "/v1/responses": "response",
}
STOP_MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request ran.",
    "batch_expired": "The batch expired before this request ran.",
    "request_cancelled": "The request was cancelled.",
}

# The lease renewed if `token` still holds it; 1 if it does.
_RENEW = Script(
    keys=("lease",),
    args=("token", "ms"),
    body="""
if redis.call('GET', lease) ~= token then return 0 end
redis.call('PEXPIRE', lease, ms)
return 1
""",
)
# The lease given up if `token` holds it.
_GIVE_UP = Script(
    keys=("lease",),
    args=("token",),
    body="""
if redis.call('GET', lease) == token then redis.call('DEL', lease) end
""",
)


class BatchRunner:
    def __init__(self, svc: Service, files: BatchFiles):
        self.svc, self.redis, self.files = svc, svc.redis, files
        self.token = uuid.uuid4().hex
        self._held: dict[str, asyncio.Task[None]] = {}
        self._look = asyncio.Event()

    def look_now(self) -> None:
        """Looks for batches to take up at once: one this API just moved in progress."""
        self._look.set()

    async def running(self) -> None:
        """Takes up every batch in progress that no API runs, for as long as this API runs."""
        try:
            while True:
                try:
                    await self._take_up()
                except Exception as e:  # Redis out of reach: the next look tries again
                    log.warning("the batch runner could not look for batches: %r", e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._look.wait(), LOOK_EVERY)
                self._look.clear()
        finally:
            for task in self._held.values():
                task.cancel()
            await asyncio.gather(*self._held.values(), return_exceptions=True)

    async def _take_up(self) -> None:
        ids: list[str] = await self.redis.zrange(keys.batches_running(), 0, -1)  # type: ignore[assignment]
        for batch_id in ids:
            if batch_id in self._held:
                continue
            if await self.redis.set(keys.batch_runner(batch_id), self.token, nx=True, px=int(LEASE * 1000)):
                task = asyncio.create_task(self._run(batch_id))
                self._held[batch_id] = task

    async def _run(self, batch_id: str) -> None:
        lease = keys.batch_runner(batch_id)
        run = LineRun(self, batch_id)
        try:
            renewed = time.monotonic()
            while not await run.step():
                await run.next_round(self.svc.settings.batch_tick)
                if time.monotonic() - renewed > LEASE / 3:
                    if not await _RENEW.run(self.redis, lease=lease, token=self.token, ms=int(LEASE * 1000)):
                        log.warning("batch %s: the lease passed to another API", batch_id)
                        return
                    renewed = time.monotonic()
        except Exception:
            log.exception("batch %s: its run stopped; another round takes it up", batch_id)
        finally:
            run.close()
            self._held.pop(batch_id, None)
            try:
                await asyncio.shield(_GIVE_UP.run(self.redis, lease=lease, token=self.token))
            except Exception as e:  # the lease runs out by itself
                log.warning("batch %s: the lease was not given up: %r", batch_id, e)


class LineRun:
    """One runner's hold on one batch: where it stands in the batch's plan, and the lines it released that have
    not been answered yet."""

    def __init__(self, runner: BatchRunner, batch_id: str):
        self.runner, self.svc, self.redis = runner, runner.svc, runner.redis
        self.batch_id = batch_id
        self.plan: Iterator[bytes] | None = None
        self.read = 0  # plan lines read
        self.ahead: list[PlanLine] = []  # read, not yet released
        self.pending: dict[int, PlanLine] = {}  # released, not yet answered
        self.model = ""  # the model its lines run on
        self.named: str | None = None  # the name they give it: the model's, or an adapter's
        self.owner = ""
        self.kind: Literal["chat", "text", "response"] = "chat"
        self.stopping_since: float | None = None
        self.wake = asyncio.Event()
        self.watching: dict[int, asyncio.Task[None]] = {}  # the line's job's `done`, awaited

    async def next_round(self, tick: float) -> None:
        """Waits for a pending line's job to end, or `tick` seconds: the round after finds what ended."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), tick)
        self.wake.clear()

    def _watch(self, line: PlanLine) -> None:
        """Wakes the run when the line's job ends, so its place goes to the next line at once."""

        async def watch() -> None:
            with contextlib.suppress(Exception):
                await self.svc.relay.done(self.job_id(line))
            self.wake.set()

        self.watching[line.number] = asyncio.create_task(watch())

    def close(self) -> None:
        for task in self.watching.values():
            task.cancel()
        self.watching.clear()

    async def step(self) -> bool:
        """One round; true once the batch has ended and what it kept is cleared."""
        h: dict[str, str] = await self.redis.hgetall(keys.batch(self.batch_id))  # type: ignore[assignment,misc]
        if not h:
            await batch_run.cleared(self.redis, self.batch_id, None)
            return True
        batch = Batch.from_redis(h)
        if self.plan is None:
            await self._open(batch)
        if batch.status in batches.ENDED:
            await batch_run.cleared(self.redis, self.batch_id, self.model)
            await self.runner.files.drop_plan(self.batch_id)
            return True
        await self._collect(batch)
        if _stop_code(batch) is not None:
            await self._stop(batch)
        elif batch.status == "in_progress":
            await self._release(batch)
            planned = not self.pending and not self.ahead and self.read >= batch.counts["total"]
            if planned and not await self._reopen_if_lines_are_lost(batch):
                await self._finish(batch)
        elif batch.status == "finalizing":
            await self._finish(batch)
        return False

    async def _open(self, batch: Batch) -> None:
        """Reads the plan up to where the batch's runners got: a line released and not answered is pending, one
        neither answered nor released (its release lost with Redis's last writes) is to be released again."""
        self.kind, self.owner = KINDS[batch.endpoint], batch.owner
        self.named = batch.model or None  # the model its lines name: maybe an adapter
        try:
            self.model = (await self.svc.models.get(batch.model)).name
        except ModelNotFound:  # no longer served: its lines fail as they are submitted
            self.model = batch.model or ""
        released_ids: list[str] = await self.redis.zrange(keys.batch_released(self.batch_id), 0, -1)  # type: ignore[assignment]
        answered_ids: list[str] = await self.redis.hkeys(keys.batch_results(self.batch_id))  # type: ignore[assignment,misc]
        released, answered = {int(n) for n in released_ids}, {int(n) for n in answered_ids}
        try:
            self.plan = await asyncio.to_thread(self.runner.files.plan, self.batch_id)
        except StoredFileMissing:  # cancelled while it was checked: nothing was planned
            self.plan = iter(())
        while self.read < batch.released:
            lines = await self._read(min(READ_AHEAD, batch.released - self.read))
            if not lines:
                break
            for line in lines:
                if line.number in released:
                    self.pending[line.number] = line
                elif line.number not in answered:
                    self.ahead.append(line)
        for line in self.pending.values():
            self._watch(line)

    async def _reopen_if_lines_are_lost(self, batch: Batch) -> bool:
        """Whether some line has no answer though the plan is done (Redis lost it): the plan is then read again,
        and each such line released again."""
        if await self.redis.hlen(keys.batch_results(self.batch_id)) >= batch.counts["total"]:  # type: ignore[misc]
            return False
        log.warning("batch %s: answers were lost; releasing their lines again", self.batch_id)
        self.close()
        self.plan, self.read, self.pending, self.ahead = None, 0, {}, []
        return True

    async def _read(self, n: int) -> list[PlanLine]:
        assert self.plan is not None
        raw = await asyncio.to_thread(lambda: list(itertools.islice(self.plan or iter(()), n)))
        self.read += len(raw)
        return [batch_run.read_plan_line(r) for r in raw]

    def job_id(self, line: PlanLine) -> str:
        return ID_PREFIX[self.kind] + line.job_request_id(self.batch_id)

    async def _collect(self, batch: Batch) -> None:
        """Answers each pending line whose job ended; submits again a line whose job is gone (lost before it ran,
        or with Redis's last writes)."""
        if not self.pending:
            return
        lines = list(self.pending.values())
        async with self.redis.pipeline(transaction=False) as pipe:
            for line in lines:
                pipe.hget(keys.job(self.job_id(line)), "status")
            statuses: list[str | None] = await pipe.execute()
        stop = _stop_code(batch)
        for line, status in zip(lines, statuses, strict=True):
            if status is None and stop is not None:
                await self._answer(line, batch_run.unanswered(self.batch_id, line, stop, STOP_MESSAGES[stop]))
            elif status is None:
                await self._submit(line)
            elif JobStatus(status).finished:
                await self._answer(line, await self._ended(line, stop))

    async def _ended(self, line: PlanLine, stop: str | None) -> Answer:
        job = await self.svc.store.get(self.job_id(line))
        if job.status is JobStatus.cancelled:
            code = stop or "request_cancelled"
            return batch_run.unanswered(self.batch_id, line, code, STOP_MESSAGES[code])
        status, body = await self._body(job)
        return batch_run.answered(self.batch_id, line, job.id, status, body)

    async def _body(self, job: Job) -> tuple[int, dict[str, Any]]:
        if job.kind == "response":
            return responses.answered(job)
        if job.status is JobStatus.failed and job.error:
            return int(job.error.get("code") or 500), {"error": job.error}
        return 200, job.result or await self.svc.store.view(job)

    async def _answer(self, line: PlanLine, answer: Answer, ran: bool = True) -> None:
        job_id = self.job_id(line) if ran else None
        await batch_run.answer(self.redis, self.batch_id, self.model, line.number, answer, job_id)
        self.pending.pop(line.number, None)
        if (task := self.watching.pop(line.number, None)) is not None:
            task.cancel()

    async def _release(self, batch: Batch) -> None:
        """Releases lines while the model's batch lines leave room: CHATQ_BATCH_LINES_PER_WORKER per live worker."""
        workers = dict((m.name, n) for m, n in await self.svc.models.live()).get(self.model, 0)
        room = max(workers, 1) * self.svc.settings.batch_lines_per_worker
        room -= await self.redis.zcard(keys.batch_lines(self.model))
        while room > 0:
            if not self.ahead:
                self.ahead = await self._read(READ_AHEAD)
                if not self.ahead:
                    return
            line = self.ahead.pop(0)
            await batch_run.release(
                self.redis, self.batch_id, self.model, line.number, self.read - len(self.ahead), time.time()
            )
            self.pending[line.number] = line
            await self._submit(line)
            if line.number in self.pending:
                self._watch(line)
            room -= 1

    async def _submit(self, line: PlanLine) -> None:
        """Submits the line's job; a request refused before it runs is answered with its error at once."""
        try:
            await self._enqueue(line)
        except ChatqError as e:
            await self._answer(
                line, batch_run.answered(self.batch_id, line, self.job_id(line), e.status, e.body()), ran=False
            )

    async def _enqueue(self, line: PlanLine) -> None:
        with contextlib.suppress(Conflict):  # released before, by a runner that stopped: its job stands
            await self._submit_job(line)

    async def _submit_job(self, line: PlanLine) -> None:
        request_id, owner = line.job_request_id(self.batch_id), self.owner
        if self.kind == "response":
            asked = ResponsesRequest.model_validate(line.body)
            ready = await responses.prepare(self.svc, asked, owner, "resp_" + request_id)
            chat = _last(ready.chat)
            await self.svc.store.submit(
                chat,
                "response",
                ready.model.name,
                [ready.prompt_ids],
                request_id,
                owner,
                response=ready.stored,
                line=True,
                adapter=ready.model.adapter,
            )
            return
        model = await self.svc.models.get(self.named)
        body: ChatCompletionRequest | CompletionRequest
        if self.kind == "chat":
            body = _last(ChatCompletionRequest.model_validate(line.body))
            prompts = [await self.svc.models.off_loop(model.chat_prompt, body)]
        else:
            body = _last(CompletionRequest.model_validate(line.body))
            prompts = await self.svc.models.off_loop(model.text_prompts, body)
        await self.svc.store.submit(
            body, self.kind, model.name, prompts, request_id, owner, line=True, adapter=model.adapter
        )

    async def _stop(self, batch: Batch) -> None:
        """Ends a batch cancelled or past its window: its running lines cancelled, the lines they and the rest of
        the plan leave unanswered reported so, then its files."""
        code = _stop_code(batch)
        assert code is not None
        to = "cancelled" if code == "batch_cancelled" else "expired"
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            for line in self.pending.values():
                await self.svc.store.cancel(self.job_id(line))
        if self.pending and time.monotonic() - self.stopping_since < STOP_GRACE:
            return
        for line in [*self.pending.values(), *self.ahead]:
            await self._answer(line, batch_run.unanswered(self.batch_id, line, code, STOP_MESSAGES[code]))
        self.ahead = []
        while lines := await self._read(READ_AHEAD):
            for line in lines:
                await self._answer(
                    line, batch_run.unanswered(self.batch_id, line, code, STOP_MESSAGES[code]), ran=False
                )
        await self._end(batch, (batch.status,), to)

    async def _finish(self, batch: Batch) -> None:
        """Every line answered: finalizing, its files written, then completed."""
        if batch.status == "in_progress":
            await batches.move(self.redis, batch, ("in_progress",), "finalizing")
        await self._end(batch, ("finalizing",), "completed")

    async def _end(self, batch: Batch, start: tuple[str, ...], to: str) -> None:
        written = await self.runner.files.write_results(batch)
        moved = await batches.move(self.redis, batch, start, to, batch.webhooks, fields=written)
        if moved:
            log.info("batch %s %s", self.batch_id, to)


def _stop_code(batch: Batch) -> str | None:
    """Why the batch's unanswered lines will stay so (it was cancelled, or its window passed); None while it runs."""
    if batch.status == "cancelling":
        return "batch_cancelled"
    if batch.status == "in_progress" and time.time() >= batch.expires_at:
        return "batch_expired"
    return None


R = TypeVar("R", ChatCompletionRequest, CompletionRequest)


def _last(request: R) -> R:
    """The line's request, after every interactive and background job in its worker's engine too."""
    return request.model_copy(update={"priority": request.priority + BATCH_ENGINE_PRIORITY})
