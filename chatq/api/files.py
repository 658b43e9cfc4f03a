"""OpenAI's Files API: /v1/files. Each file's bytes are in the file store (chatq.core.filestore) and its record in
Redis (chatq.core.files); a file is shown only to the owner whose API key uploaded it. Each API also sweeps expired
and deleted files' bytes from the store."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import quote

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from chatq.api.auth import Owner, authenticate
from chatq.api.uploads import Upload
from chatq.core import files, keys
from chatq.core.errors import FileNotFound, UploadLapsed
from chatq.core.files import FileRecord
from chatq.core.filestore import FileStore, Readable, StoredFileMissing, chunks
from chatq.core.settings import Settings

log = logging.getLogger(__name__)

# Ids are part of Redis key names and the store's names: nothing but what new_id makes passes.
FILE_ID = re.compile(r"file-[A-Za-z0-9]{1,64}")
# Ids read from an owner's list at a time while a page is gathered.
LIST_BATCH = 500
# Due files one sweep takes at a time.
SWEEP_BATCH = 100


@dataclass(frozen=True)
class FilePage:
    """Which of an owner's files a list shows: at most `limit`, after the file `after`, newest first (`desc`) or in
    upload order, of one purpose or all."""

    limit: int = 10_000
    after: str | None = None
    desc: bool = True
    purpose: str | None = None


class Files:
    def __init__(self, client: aioredis.Redis, store: FileStore, settings: Settings):
        self.redis, self.store, self.settings = client, store, settings
        self._detached: set[asyncio.Task[None]] = set()

    async def upload(self, request: Request, owner: str) -> FileRecord:
        """Stores the request's file and records it; on any failure, nothing of it is kept."""
        file_id = files.new_id()
        await files.lease(self.redis, file_id, time.time())
        try:
            got = await Upload(self.store, file_id, self.settings, lambda: self._touch(file_id)).read(request)
            now = time.time()
            expiry = got.form.expires_after.seconds if got.form.expires_after else None
            if expiry is None and got.form.purpose == "batch":
                expiry = files.BATCH_EXPIRY
            record = FileRecord(
                id=file_id,
                owner=owner,
                bytes=got.bytes,
                lines=got.lines,
                created_at=int(now),
                filename=got.filename,
                purpose=got.form.purpose,
                expires_at=None if expiry is None else int(now) + expiry,
            )
            if not await files.commit(self.redis, record, now):
                raise UploadLapsed(files.UPLOAD_LEASE)
        except BaseException:
            # Done before the answer, and to the end even when this request's task is being cancelled.
            await asyncio.shield(self._detach(self._discard(file_id, owner)))
            raise
        log.info("file %s stored: %d bytes, purpose %s", file_id, record.bytes, record.purpose)
        return record

    async def _touch(self, file_id: str) -> None:
        if not await files.extend(self.redis, file_id, time.time()):
            raise UploadLapsed(files.UPLOAD_LEASE)

    async def _discard(self, file_id: str, owner: str) -> None:
        """Deletes what a failed upload stored; should this fail too, the sweep deletes it once its lease ends."""
        try:
            await files.take(self.redis, file_id, owner)
            await self._drop_bytes(file_id)
        except Exception as e:
            log.warning("file %s: a failed upload's bytes are left to the sweep: %r", file_id, e)

    def _detach(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)
        return task

    async def _drop_bytes(self, file_id: str) -> None:
        await asyncio.to_thread(self.store.delete, file_id)
        await files.settled(self.redis, file_id)

    async def get(self, file_id: str, owner: str) -> FileRecord:
        """The file's record, if `owner` may see it: another owner's file, and one expired, are not found."""
        if FILE_ID.fullmatch(file_id) is None:
            raise FileNotFound(file_id)
        h: dict[str, str] = await self.redis.hgetall(keys.file(file_id))  # type: ignore[assignment,misc]
        record = _readable(h)
        if record is None or not hmac.compare_digest(record.owner, owner) or record.expired(time.time()):
            raise FileNotFound(file_id)
        return record

    async def open(self, file_id: str, owner: str) -> tuple[FileRecord, Readable]:
        """The file's record and its bytes, opened."""
        record = await self.get(file_id, owner)
        try:
            return record, await asyncio.to_thread(self.store.open, record.id)
        except StoredFileMissing:  # deleted since its record was read
            raise FileNotFound(file_id) from None

    async def delete(self, file_id: str, owner: str) -> None:
        """Removes the file's record at once, then its bytes (left to the sweep if the store fails now)."""
        record = await self.get(file_id, owner)
        if not await files.take(self.redis, record.id, owner):
            raise FileNotFound(file_id)
        try:
            await self._drop_bytes(record.id)
        except Exception as e:
            log.warning("file %s deleted; its bytes are left to the sweep: %r", file_id, e)

    async def list(self, owner: str, page: FilePage) -> tuple[list[FileRecord], bool]:
        """A page of the owner's files, and whether more follow it; ids whose record is gone leave the list."""
        key, now = keys.owner_files(owner), time.time()
        start = await self._page_start(key, page)
        found: list[FileRecord] = []
        gone: list[str] = []
        while len(found) <= page.limit:
            ids: list[str] = await self.redis.zrange(key, start, start + LIST_BATCH - 1, desc=page.desc)  # type: ignore[assignment]
            if not ids:
                break
            start += len(ids)
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in ids:
                    pipe.hgetall(keys.file(file_id))
                records: list[dict[str, str]] = await pipe.execute()
            for file_id, h in zip(ids, records, strict=True):
                record = _readable(h)
                if record is None or record.owner != owner:
                    gone.append(file_id)
                elif not record.expired(now) and page.purpose in (None, record.purpose):
                    found.append(record)
        if gone:
            await self.redis.zrem(key, *gone)
        return found[: page.limit], len(found) > page.limit

    async def _page_start(self, key: str, page: FilePage) -> int:
        if page.after is None:
            return 0
        read = self.redis.zrevrank if page.desc else self.redis.zrank
        rank: int | None = await read(key, page.after)  # type: ignore[assignment]
        if rank is None:
            raise FileNotFound(page.after, "after")
        return rank + 1

    async def sweep(self) -> int:
        """Deletes the bytes of up to SWEEP_BATCH due files (expired, deleted, or uploads whose lease ended) and
        their records; how many it took."""
        due: list[str] = await self.redis.zrangebyscore(keys.files_due(), "-inf", time.time(), 0, SWEEP_BATCH)  # type: ignore[assignment]
        taken = 0
        for file_id in due:
            owner: str = await self.redis.hget(keys.file(file_id), "owner") or ""  # type: ignore[misc,assignment]
            if await files.take(self.redis, file_id, owner, due_only=True):
                await self._drop_bytes(file_id)
                taken += 1
        return taken

    async def sweeping(self) -> None:
        """Sweeps every CHATQ_FILES_SWEEP_INTERVAL seconds, for as long as the API runs."""
        while True:
            await asyncio.sleep(self.settings.files_sweep_interval)
            try:
                while await self.sweep() == SWEEP_BATCH:
                    pass
            except Exception as e:  # Redis or the store out of reach: the next sweep tries again
                log.warning("the files sweep failed: %r", e)


def _readable(h: dict[str, str]) -> FileRecord | None:
    """The record, or None for none or one this version cannot read."""
    if not h:
        return None
    try:
        return FileRecord.from_redis(h)
    except (KeyError, ValueError):
        return None


def _files(request: Request) -> Files:
    return request.app.state.files


FilesDep = Annotated[Files, Depends(_files)]
router = APIRouter(dependencies=[Depends(authenticate)])

# The body FastAPI does not read itself (Upload streams it), as OpenAI's schema gives it.
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(files.PURPOSES)},
                        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": files.MAX_EXPIRY},
                    },
                }
            }
        },
    }
}


@router.post("/v1/files", openapi_extra=UPLOAD_BODY)
async def create_file(request: Request, svc: FilesDep, owner: Owner) -> Any:
    return (await svc.upload(request, owner)).view()


@router.get("/v1/files")
async def list_files(
    svc: FilesDep,
    owner: Owner,
    after: str | None = None,
    limit: int = Query(default=10_000, ge=1, le=10_000),
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> Any:
    found, has_more = await svc.list(owner, FilePage(limit, after, order == "desc", purpose))
    data = [record.view() for record in found]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, svc: FilesDep, owner: Owner) -> Any:
    return (await svc.get(file_id, owner)).view()


@router.get("/v1/files/{file_id}/content")
async def retrieve_file_content(file_id: str, svc: FilesDep, owner: Owner) -> StreamingResponse:
    record, opened = await svc.open(file_id, owner)
    headers = {
        "content-length": str(record.bytes),
        "content-disposition": f"attachment; filename*=UTF-8''{quote(record.filename, safe='')}",
    }
    body: Iterator[bytes] = chunks(opened)  # read in Starlette's threads, a chunk at a time
    return StreamingResponse(body, media_type="application/octet-stream", headers=headers)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, svc: FilesDep, owner: Owner) -> Any:
    await svc.delete(file_id, owner)
    return {"id": file_id, "object": "file", "deleted": True}
