"""OpenAI's Batch API: /v1/batches. A batch's record is in Redis (chatq.core.batches); its input file is one of its
owner's files (chatq.api.files), whose lines the API checks before the batch goes in progress. A batch is shown only
to the owner whose API key created it."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel

from chatq.api.auth import Owner, authenticate
from chatq.api.batch_files import BatchFiles
from chatq.api.files import Files
from chatq.api.models import Models
from chatq.core import api_keys, batches, files, keys
from chatq.core.api_keys import ApiKey
from chatq.core.batches import Batch, LineCheck, LineError
from chatq.core.errors import BadRequest, BatchNotFound, FileNotFound, ModelNotFound
from chatq.core.filestore import chunks
from chatq.core.webhooks import WebhookMessages

log = logging.getLogger(__name__)

# Ids are part of Redis key names: nothing but what new_id makes passes.
BATCH_ID = re.compile(r"batch_[A-Za-z0-9]{1,64}")


class BatchCreate(BaseModel):
    """POST /v1/batches's body; its values are checked by Batches.create, so each refusal names its field."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: dict[str, Any] | None = None


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > batches.METADATA_PAIRS:
        raise BadRequest(f"metadata holds at most {batches.METADATA_PAIRS} pairs.", "metadata")
    for k, v in metadata.items():
        if len(k) > batches.METADATA_KEY:
            raise BadRequest(f"A metadata key is at most {batches.METADATA_KEY} characters.", "metadata")
        if not isinstance(v, str) or len(v) > batches.METADATA_VALUE:
            raise BadRequest(
                f"A metadata value is a string of at most {batches.METADATA_VALUE} characters.", "metadata"
            )


def _check_expiry(expires_after: dict[str, Any] | None) -> int | None:
    """The seconds `output_expires_after` gives the batch's output files, as the files' `expires_after` is read."""
    if expires_after is None:
        return None
    seconds = expires_after.get("seconds")
    if expires_after.get("anchor") != "created_at":
        raise BadRequest("output_expires_after.anchor must be 'created_at'.", "output_expires_after.anchor")
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not 3600 <= seconds <= files.MAX_EXPIRY:
        message = f"output_expires_after.seconds must be an integer from 3600 to {files.MAX_EXPIRY}."
        raise BadRequest(message, "output_expires_after.seconds")
    return seconds


def _lines(stream: Iterator[bytes]) -> Iterator[str]:
    """The file's non-empty lines, decoded."""
    rest = b""
    for chunk in stream:
        rest += chunk
        *whole, rest = rest.split(b"\n")
        yield from (line.decode("utf-8", "replace") for line in whole if line.strip())
    if rest.strip():
        yield rest.decode("utf-8", "replace")


class Batches:
    def __init__(
        self,
        client: aioredis.Redis,
        stored: Files,
        models: Models,
        batch_files: BatchFiles,
        started: Callable[[], None],
    ):
        self.redis, self.files, self.models = client, stored, models
        self.batch_files, self.started = batch_files, started
        self.webhooks = WebhookMessages.of(stored.settings)
        self._validating: dict[str, asyncio.Task[None]] = {}

    async def create(self, body: BatchCreate, owner: str) -> Batch:
        """Records a batch of the owner's `batch` file and starts checking its lines; a bad field is a 400."""
        if body.endpoint not in batches.ENDPOINTS:
            raise BadRequest(f"endpoint must be one of {', '.join(batches.ENDPOINTS)}.", "endpoint")
        if body.completion_window not in batches.WINDOWS:
            raise BadRequest("completion_window must be '24h'.", "completion_window")
        _check_metadata(body.metadata)
        output_expiry = _check_expiry(body.output_expires_after)
        try:
            record = await self.files.get(body.input_file_id, owner)
        except FileNotFound:
            raise BadRequest(f"No file found with id '{body.input_file_id}'.", "input_file_id") from None
        if record.purpose != "batch":
            raise BadRequest("The input file's purpose must be 'batch'.", "input_file_id")
        listed_at = time.time()
        now = int(listed_at)
        window = self.files.settings.batch_window or batches.WINDOWS[body.completion_window]
        batch = Batch(
            id=batches.new_id(),
            owner=owner,
            endpoint=body.endpoint,
            input_file_id=record.id,
            completion_window=body.completion_window,
            created_at=now,
            expires_at=now + window,
            metadata=body.metadata,
            output_expires_after=output_expiry,
        )
        batch.webhooks = self._webhook(batch.id)
        await batches.create(self.redis, batch, listed_at)
        self._start_validating(batch)
        log.info("batch %s created from %s", batch.id, record.id)
        return batch

    def _start_validating(self, batch: Batch) -> None:
        """Checks the batch's lines in a task of this process, unless one already does."""
        if batch.id in self._validating:
            return
        task = asyncio.create_task(self.validate(batch))
        self._validating[batch.id] = task
        task.add_done_callback(lambda _: self._validating.pop(batch.id, None))

    async def validate(self, batch: Batch) -> None:
        """Checks every line of the batch's input file: the batch goes in progress, or fails naming its bad lines
        (or, past its key's batch tokens, the limit)."""
        try:
            check, errors = await self._check_lines(batch)
        except FileNotFound:
            check, errors = None, [LineError("invalid_file", "The input file is gone.", None, "input_file_id")]
        key = await api_keys.by_hash(self.redis, batch.owner)
        if check is not None and not errors:
            errors = await self._check_models(check, key)
        if errors:
            await self._fail(batch, errors)
            return
        assert check is not None
        await self.batch_files.write_plan(batch, check.kept)
        model = next(iter(check.models))
        hold = await self._hold(check, model, key)
        total = str(check.lines)
        moved = await batches.move(
            self.redis, batch, ("validating",), "in_progress", hold=hold, fields={"total": total, "model": model}
        )
        if moved == -1 and hold is not None:
            await self.batch_files.drop_plan(batch.id)
            await self._fail(batch, [_over_limit(model, hold.limit)])
        elif moved == 1:
            self.started()

    async def _fail(self, batch: Batch, errors: list[LineError]) -> None:
        views = [e.view() for e in errors[: batches.MAX_ERRORS]]
        await batches.move(self.redis, batch, ("validating",), "failed", batch.webhooks, fields={"errors": views})
        log.info("batch %s failed validation: %d errors", batch.id, len(errors))

    async def _hold(self, check: LineCheck, model: str, key: ApiKey | None) -> batches.Hold | None:
        """What the batch holds of its key's batch tokens, if the key has a limit on them: its lines' input tokens."""
        if key is None or key.limits.batch_tokens is None:
            return None
        served = await self.models.get(model or None, key=key)
        tokens = await self.models.off_loop(batches.input_tokens, served.renderer.tokenizer, check.kept)
        return batches.Hold(model, tokens, key.limits.batch_tokens)

    async def _check_lines(self, batch: Batch) -> tuple[LineCheck, list[LineError]]:
        _, opened = await self.files.open(batch.input_file_id, batch.owner)
        check = LineCheck(batch.endpoint)

        def run() -> list[LineError]:
            found: list[LineError] = []
            for number, text in enumerate(_lines(chunks(opened)), start=1):
                if (error := check.check(number, text)) is None:
                    check.keep(number, text)
                elif len(found) < batches.MAX_ERRORS:
                    found.append(error)
            return found

        errors = await asyncio.to_thread(run)
        if check.lines == 0:
            errors.append(LineError("empty_file", "The input file has no requests.", None, "input_file_id"))
        return check, errors

    async def _check_models(self, check: LineCheck, key: ApiKey | None) -> list[LineError]:
        """`key`: the managed key of the batch's owner, if it is one."""
        errors = []
        for model, line in check.models.items():
            try:
                await self.models.get(model or None, key=key)
            except ModelNotFound as e:
                errors.append(LineError("model_not_found", e.message, line, "body.model"))
        if len(check.models) > 1 and not errors:
            first = sorted(check.models.values())[1]
            errors.append(
                LineError("mismatched_model", "Every line of a batch must name one model.", first, "body.model")
            )
        return errors

    def _webhook(self, batch_id: str) -> str:
        """The webhook messages a batch's end sends, "" without webhook URLs."""
        return "" if self.webhooks is None else self.webhooks.block(batch_id)

    async def get(self, batch_id: str, owner: str) -> Batch:
        """The batch, if `owner` may see it: another owner's batch is not found."""
        if BATCH_ID.fullmatch(batch_id) is None:
            raise BatchNotFound(batch_id)
        h: dict[str, str] = await self.redis.hgetall(keys.batch(batch_id))  # type: ignore[assignment,misc]
        if not h or not hmac.compare_digest(h.get("owner", ""), owner):
            raise BatchNotFound(batch_id)
        return await self._expire(Batch.from_redis(h))

    async def _expire(self, batch: Batch) -> Batch:
        """The batch, `expired` if its window passed while it was checked; one left `validating` by an API that
        stopped is checked again here (only one check's move takes). A batch in progress is its runner's to end."""
        if batch.status == "validating" and batch.expires_at > time.time():
            self._start_validating(batch)
        if batch.status != "validating" or batch.expires_at > time.time():
            return batch
        await batches.move(self.redis, batch, ("validating",), "expired", batch.webhooks)
        h: dict[str, str] = await self.redis.hgetall(keys.batch(batch.id))  # type: ignore[assignment,misc]
        return Batch.from_redis(h)

    async def cancel(self, batch_id: str, owner: str) -> Batch:
        """Cancels a batch not yet ended: `cancelling`, then (its runner moves it) `cancelled` once none of its
        lines runs."""
        batch = await self.get(batch_id, owner)
        await batches.move(self.redis, batch, batches.CANCELLABLE, "cancelling")
        return await self.get(batch_id, owner)

    async def list(self, owner: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """A page of the owner's batches, newest first, and whether more follow it."""
        key, start = keys.owner_batches(owner), 0
        if after is not None:
            rank: int | None = await self.redis.zrevrank(key, after)  # type: ignore[assignment]
            if rank is None:
                raise BatchNotFound(after, "after")
            start = rank + 1
        ids: list[str] = await self.redis.zrevrange(key, start, start + limit)  # type: ignore[assignment]
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.hgetall(keys.batch(batch_id))
            records: list[dict[str, str]] = await pipe.execute()
        found = [await self._expire(Batch.from_redis(h)) for h in records if h and h.get("owner") == owner]
        return found[:limit], len(ids) > limit


def _batches(request: Request) -> Batches:
    return request.app.state.batches


BatchesDep = Annotated[Batches, Depends(_batches)]
router = APIRouter(dependencies=[Depends(authenticate)])


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, svc: BatchesDep, owner: Owner) -> Any:
    return (await svc.create(body, owner)).view()


@router.get("/v1/batches")
async def list_batches(
    svc: BatchesDep, owner: Owner, after: str | None = None, limit: int = Query(default=20, ge=1, le=100)
) -> Any:
    found, has_more = await svc.list(owner, after, limit)
    data = [batch.view() for batch in found]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, svc: BatchesDep, owner: Owner) -> Any:
    return (await svc.get(batch_id, owner)).view()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, svc: BatchesDep, owner: Owner) -> Any:
    return (await svc.cancel(batch_id, owner)).view()


def _over_limit(model: str, limit: int) -> LineError:
    """OpenAI's error for a batch past its key's enqueued tokens."""
    message = (
        f"Enqueued token limit reached for {model or 'the default model'}. Limit: {limit:,} enqueued tokens. "
        "Please try again once some in_progress batches have been completed."
    )
    return LineError("token_limit_exceeded", message, None)
