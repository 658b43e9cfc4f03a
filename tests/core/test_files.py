"""A file's record and the scripts that keep records and stored bytes in step, on the session's real Redis: an upload
is recorded only while its lease holds, a file taken away can never be recorded again, and the sweep takes only
what is due."""

from __future__ import annotations

import time
import uuid

import openai
import pytest
import redis

from chatq.core import files, keys
from chatq.core.files import FileRecord


def record(expires_at: int | None = None, owner: str = "") -> FileRecord:
    return FileRecord(
        id=files.new_id(),
        owner=owner or uuid.uuid4().hex,
        bytes=12,
        lines=2,
        created_at=int(time.time()),
        filename="requests.jsonl",
        purpose="batch",
        expires_at=expires_at,
    )


def due(r: redis.Redis, file_id: str) -> float | None:
    return r.zscore(keys.files_due(), file_id)


def test_a_record_reads_back_and_shows_as_openais_file_object() -> None:
    made = record(expires_at=2_000_000_000)
    assert FileRecord.from_redis(made.to_redis()) == made
    assert FileRecord.from_redis(record().to_redis()).expires_at is None
    view = made.view()
    assert set(view) == set(openai.types.FileObject.model_fields)
    shown = openai.types.FileObject.model_validate(view)
    assert (shown.id, shown.object, shown.status, shown.expires_at) == (made.id, "file", "processed", 2_000_000_000)
    assert made.id.startswith("file-")


@pytest.mark.parametrize("expires_at", [None, 2_000_000_000])
def test_an_upload_is_recorded_while_its_lease_holds(r: redis.Redis, expires_at: int | None) -> None:
    made, now = record(expires_at), time.time()
    files.lease(r, made.id, now)
    assert due(r, made.id) == pytest.approx(now + files.UPLOAD_LEASE)
    assert files.extend(r, made.id, now + 60) == 1
    assert due(r, made.id) == pytest.approx(now + 60 + files.UPLOAD_LEASE)
    assert files.commit(r, made, now) == 1
    assert FileRecord.from_redis(r.hgetall(keys.file(made.id))) == made
    assert r.zscore(keys.owner_files(made.owner), made.id) == pytest.approx(now)
    assert due(r, made.id) == expires_at  # an expiry stays due; a file that never expires leaves the set


def test_a_lapsed_lease_is_neither_lengthened_nor_recorded(r: redis.Redis) -> None:
    made = record()
    files.lease(r, made.id, time.time() - files.UPLOAD_LEASE - 1)
    assert files.extend(r, made.id, time.time()) == 0
    assert files.commit(r, made, time.time()) == 0
    assert not r.exists(keys.file(made.id)) and r.zscore(keys.owner_files(made.owner), made.id) is None


def test_an_upload_taken_away_can_never_be_recorded(r: redis.Redis) -> None:
    made = record()
    files.lease(r, made.id, time.time())
    assert files.take(r, made.id, made.owner) == 1
    assert due(r, made.id) == 0  # its bytes are due at once
    assert files.extend(r, made.id, time.time()) == 0
    assert files.commit(r, made, time.time()) == 0
    assert not r.exists(keys.file(made.id))


def test_the_sweep_takes_a_file_only_once_it_is_due_and_until_its_bytes_are_gone(r: redis.Redis) -> None:
    made = record(expires_at=int(time.time()) + 3600)
    files.lease(r, made.id, time.time())
    files.commit(r, made, time.time())
    assert files.take(r, made.id, made.owner, due_only=True) == 0
    assert r.exists(keys.file(made.id))
    r.zadd(keys.files_due(), {made.id: time.time() - 1})  # its expiry passed
    assert files.take(r, made.id, made.owner, due_only=True) == 1
    assert not r.exists(keys.file(made.id)) and r.zscore(keys.owner_files(made.owner), made.id) is None
    # A sweeper that died before deleting the bytes leaves the file due for the next one.
    assert files.take(r, made.id, made.owner, due_only=True) == 1
    files.settled(r, made.id)
    assert due(r, made.id) is None
    assert files.take(r, made.id, made.owner, due_only=True) == 0


def test_taking_a_file_that_never_was_changes_nothing(r: redis.Redis) -> None:
    assert files.take(r, "file-neverwas", "someone") == 0
    assert due(r, "file-neverwas") is None


def test_a_deleted_file_leaves_its_owners_list_and_is_due_at_once(r: redis.Redis) -> None:
    made = record()
    files.lease(r, made.id, time.time())
    files.commit(r, made, time.time())
    assert due(r, made.id) is None
    assert files.take(r, made.id, made.owner) == 1
    assert not r.exists(keys.file(made.id)) and r.zcard(keys.owner_files(made.owner)) == 0
    assert due(r, made.id) == 0
