"""A file's record in Redis (its FileObject and owner), and the scripts that keep records and stored bytes in step.

A file's bytes go into the store (chatq.core.filestore) before its record is written, and leave it after the record
is gone; the set keys.files_due() holds, meanwhile, every file whose bytes are to leave the store and when: an upload
not yet recorded (at the end of its lease, which it lengthens while it streams), a file that expires (at its expiry),
a deleted one (at once, score 0). The sweep deletes the bytes of every due file, then drops it from the set, so a
process that dies between the two leaves it there for the next sweep: no bytes outlive their record for longer than
a sweep, and none are deleted under a record. Each script reads the time from Redis, which all processes share.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import redis
import redis.asyncio as aioredis

from chatq.core import keys
from chatq.core.lua import SERVER_NOW, Script

# What a client may upload a file for (OpenAI's purposes); `batch_output` is chatq's own, for a batch's results.
Purpose = Literal["assistants", "batch", "fine-tune", "vision", "user_data", "evals"]
PURPOSES: tuple[str, ...] = get_args(Purpose)
BATCH_OUTPUT = "batch_output"
# OpenAI's bounds: at most 30 days for `expires_after`, and at most 50,000 requests in a batch's input file.
MAX_EXPIRY = 30 * 86400
BATCH_LINES = 50_000
# A `batch` file uploaded without `expires_after` expires after 30 days, as OpenAI's do.
BATCH_EXPIRY = 30 * 86400
# Seconds an upload may go without sending anything before the sweep may delete what it stored.
UPLOAD_LEASE = 600

Client = redis.Redis | aioredis.Redis


def new_id() -> str:
    return "file-" + uuid.uuid4().hex


@dataclass(frozen=True)
class FileRecord:
    """A stored file: what GET /v1/files/{id} shows, its owner (the hash of its API key, or empty) and its lines."""

    id: str
    owner: str
    bytes: int
    lines: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None

    def to_redis(self) -> dict[str, str]:
        return {k: "" if v is None else str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_redis(cls, h: dict[str, str]) -> FileRecord:
        return cls(
            id=h["id"],
            owner=h.get("owner", ""),
            bytes=int(h["bytes"]),
            lines=int(h.get("lines") or 0),
            created_at=int(h["created_at"]),
            filename=h["filename"],
            purpose=h["purpose"],
            expires_at=int(h["expires_at"]) if h.get("expires_at") else None,
        )

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def view(self) -> dict[str, Any]:
        """OpenAI's FileObject."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": self.expires_at,
            "status_details": None,
        }


# An upload's lease in the due set, lengthened to `lease_end`: only while it has not run out, as the sweep may then have
# deleted what the upload stored.
_EXTEND = Script(
    keys=("due",),
    args=("file_id", "lease_end"),
    uses=(SERVER_NOW,),
    body="""
local score = redis.call('ZSCORE', due, file_id)
if not score or tonumber(score) <= server_now() then
  return 0
end
redis.call('ZADD', due, lease_end, file_id)
return 1
""",
)

# The record of an upload whose bytes are stored, and its place in its owner's list; its due entry becomes its expiry,
# or goes. Refused (0) once the lease ran out.
_COMMIT = Script(
    keys=("record", "listing", "due"),
    args=("file_id", "listed_at", "expires_at"),
    tail="fields",
    uses=(SERVER_NOW,),
    body="""
local score = redis.call('ZSCORE', due, file_id)
if not score or tonumber(score) <= server_now() then
  return 0
end
redis.call('HSET', record, unpack(fields))
redis.call('ZADD', listing, listed_at, file_id)
if expires_at == '' then
  redis.call('ZREM', due, file_id)
else
  redis.call('ZADD', due, expires_at, file_id)
end
return 1
""",
)

# Takes the record away if `due_only` is empty or the file is due (its expiry or its upload's lease passed): its id
# leaves the owner's list and is due at once (0), which no lease or commit can change back. 1 if it was taken.
_TAKE = Script(
    keys=("record", "listing", "due"),
    args=("file_id", "due_only"),
    uses=(SERVER_NOW,),
    body="""
local score = redis.call('ZSCORE', due, file_id)
if due_only ~= '' and (not score or tonumber(score) > server_now()) then
  return 0
end
local existed = redis.call('DEL', record)
redis.call('ZREM', listing, file_id)
if existed == 0 and not score then
  return 0
end
redis.call('ZADD', due, 0, file_id)
return 1
""",
)


def lease(client: Client, file_id: str, now: float) -> Any:
    """Enters an upload in the due set until its lease ends, before any of its bytes are stored."""
    return client.zadd(keys.files_due(), {file_id: now + UPLOAD_LEASE})


def extend(client: Client, file_id: str, now: float) -> Any:
    """Lengthens the upload's lease from `now`; false (awaited, for an asyncio client) if it had run out."""
    return _EXTEND.run(client, due=keys.files_due(), file_id=file_id, lease_end=now + UPLOAD_LEASE)


def commit(client: Client, record: FileRecord, listed_at: float) -> Any:
    """Writes the record of an upload whose bytes are stored; false if its lease had run out (its bytes are then
    the sweep's to delete)."""
    expires = "" if record.expires_at is None else str(record.expires_at)
    fields = [x for kv in record.to_redis().items() for x in kv]
    return _COMMIT.run(
        client,
        record=keys.file(record.id),
        listing=keys.owner_files(record.owner),
        due=keys.files_due(),
        file_id=record.id,
        listed_at=listed_at,
        expires_at=expires,
        fields=fields,
    )


def take(client: Client, file_id: str, owner: str, due_only: bool = False) -> Any:
    """Removes the record (`due_only`: only if the file is due) and makes its bytes due at once; true if it did."""
    return _TAKE.run(
        client,
        record=keys.file(file_id),
        listing=keys.owner_files(owner),
        due=keys.files_due(),
        file_id=file_id,
        due_only="1" if due_only else "",
    )


def settled(client: Client, file_id: str) -> Any:
    """Drops a file whose bytes left the store from the due set."""
    return client.zrem(keys.files_due(), file_id)
