"""A batch's files in the file store: its plan (the input's lines in the order they run), and the output and error
files its answered lines become, owned by the batch's owner with purpose `batch_output`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Iterator

from chatq.api.files import Files
from chatq.core import batch_run, files, keys
from chatq.core.batches import Batch
from chatq.core.files import FileRecord

# Seconds a plan outlives its batch's window before the sweep deletes it, should no runner have.
PLAN_SLACK = 86400


class BatchFiles:
    def __init__(self, stored: Files):
        self.files, self.redis, self.store = stored, stored.redis, stored.store

    async def write_plan(self, batch: Batch, lines: Iterable[tuple[int, str]]) -> None:
        """Writes the batch's plan from its input's checked (number, text) lines; the sweep deletes it after the
        batch's window, unless its runner did."""
        name = batch_run.plan_name(batch.id)
        await self.redis.zadd(keys.files_due(), {name: batch.expires_at + PLAN_SLACK})
        await asyncio.to_thread(self.store.put, name, batch_run.plan_lines(lines))

    def plan(self, batch_id: str) -> Iterator[bytes]:
        """The plan's lines (blocking: read in a thread); StoredFileMissing if it has none."""
        return self.store.lines(batch_run.plan_name(batch_id))

    async def drop_plan(self, batch_id: str) -> None:
        await self.redis.zadd(keys.files_due(), {batch_run.plan_name(batch_id): 0})

    async def write_results(self, batch: Batch) -> dict[str, str]:
        """Writes the output and error files from the batch's answered lines, in input order; the record's fields
        naming them ("" for a file with no lines)."""
        found = await batch_run.results(self.redis, batch.id)
        written = {}
        for kind in ("output", "error"):
            lines = [found[n]["line"] for n in sorted(found) if found[n]["kind"] == kind]
            file_id = batch_run.output_file_id(batch.id, kind)
            written[f"{kind}_file_id"] = await self._write(batch, file_id, kind, lines) if lines else ""
        return written

    async def _write(self, batch: Batch, file_id: str, kind: str, lines: list[dict]) -> str:
        now = time.time()
        data = b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
        await files.lease(self.redis, file_id, now)
        await asyncio.to_thread(self.store.put, file_id, [data])
        expiry = batch.output_expires_after or files.BATCH_EXPIRY
        record = FileRecord(
            id=file_id,
            owner=batch.owner,
            bytes=len(data),
            lines=len(lines),
            created_at=int(now),
            filename=f"{batch.id}_{kind}.jsonl",
            purpose=files.BATCH_OUTPUT,
            expires_at=int(now) + expiry,
        )
        await files.commit(self.redis, record, now)
        return file_id
