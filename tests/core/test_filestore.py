"""The file stores, a directory and an S3 bucket (moto's server, over HTTP) alike: what is written is read back whole,
by chunks and by lines; a write not committed leaves nothing; a delete takes what is there and minds what is not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chatq.core.filestore import (
    CHUNK,
    S3_PART,
    FileStore,
    LocalStore,
    S3Store,
    StoredFileMissing,
    chunks,
    file_store,
)
from chatq.core.settings import Settings
from tests.helpers import AWS_ENV, S3Server

EVERY_BYTE = bytes(range(256)) * 64


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FileStore:
    if request.param == "local":
        return LocalStore(tmp_path / "files")
    s3: S3Server = request.getfixturevalue("s3")
    return S3Store(s3.new_bucket(), prefix="chatq/", client=s3.client())


def held(store: FileStore) -> set[str]:
    """Every name the store holds, unfinished writes' included."""
    if isinstance(store, LocalStore):
        return set(os.listdir(store.root))
    assert isinstance(store, S3Store)
    objects = store.client.list_objects_v2(Bucket=store.bucket).get("Contents", [])
    uploads = store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    return {o["Key"] for o in objects} | {u["Key"] + " (unfinished)" for u in uploads}


def read(store: FileStore, name: str) -> bytes:
    return b"".join(chunks(store.open(name)))


def test_a_file_is_read_back_as_it_was_written(store: FileStore) -> None:
    pieces = [EVERY_BYTE, b"", b"\r\n", EVERY_BYTE[:7]]
    assert store.put("file-a", pieces) == sum(map(len, pieces))
    assert read(store, "file-a") == b"".join(pieces)
    assert held(store) == ({"file-a"} if isinstance(store, LocalStore) else {"chatq/file-a"})


def test_a_file_of_several_parts_is_read_back_whole(store: FileStore) -> None:
    data = os.urandom(2 * S3_PART + 12345)
    store.put("file-big", (data[i : i + 1_000_003] for i in range(0, len(data), 1_000_003)))
    assert read(store, "file-big") == data
    assert all(len(c) <= CHUNK for c in chunks(store.open("file-big")))
    if isinstance(store, S3Store):  # S3 names a multipart object's ETag by its count of parts
        etag = store.client.head_object(Bucket=store.bucket, Key="chatq/file-big")["ETag"]
        assert etag.strip('"').endswith("-3")


def test_lines_come_without_their_ends_however_the_chunks_fall(store: FileStore) -> None:
    long = b"x" * (2 * CHUNK + 17)  # a line across three chunks
    store.put("file-lines", [b'{"a":1}\n{"b"', b":2}\r\n\n", long, b"\nlast"])
    assert list(store.lines("file-lines")) == [b'{"a":1}', b'{"b":2}', b"", long, b"last"]
    store.put("file-ended", [b"one\ntwo\n"])
    assert list(store.lines("file-ended")) == [b"one", b"two"]


def test_a_write_not_committed_leaves_nothing(store: FileStore) -> None:
    writer = store.create("file-w")
    writer.write(os.urandom(S3_PART + 10))  # a part already sent, for S3
    with pytest.raises(StoredFileMissing):
        store.open("file-w")
    writer.abort()
    with pytest.raises(RuntimeError), store.create("file-x") as w:
        w.write(b"half")
        raise RuntimeError("the upload broke")
    assert held(store) == set()


def test_a_commit_replaces_the_file_of_its_name(store: FileStore) -> None:
    store.put("file-r", [b"first"])
    store.put("file-r", [b"second"])
    assert read(store, "file-r") == b"second"


def test_a_delete_takes_the_file_and_minds_none(store: FileStore) -> None:
    store.put("file-d", [b"bytes"])
    store.delete("file-d")
    store.delete("file-d")
    store.delete("file-never")
    with pytest.raises(StoredFileMissing):
        store.open("file-d")
    assert held(store) == set()


def test_a_delete_takes_an_unfinished_write_from_the_directory(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.create("file-u").write(b"a crashed upload's bytes")
    assert held(store) == {".file-u.part"}
    store.delete("file-u")
    assert held(store) == set()


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "x" * 300, "a\x00b"])
def test_a_name_that_could_reach_outside_the_store_is_refused(store: FileStore, name: str) -> None:
    for call in (store.create, store.open, store.delete):
        with pytest.raises(ValueError):
            call(name)


def test_the_settings_choose_the_store(tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(cache_dir=tmp_path).files_path == tmp_path / "files"
    local = file_store(Settings(files_dir=tmp_path / "elsewhere"))
    assert isinstance(local, LocalStore) and local.root == tmp_path / "elsewhere" and local.root.is_dir()
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    bucket = s3.new_bucket()
    remote = file_store(Settings(files_s3_bucket=bucket, files_s3_endpoint_url=s3.endpoint, files_s3_prefix="p/"))
    assert isinstance(remote, S3Store)
    remote.put("file-s", [b"through boto3's own client"])
    assert s3.client().get_object(Bucket=bucket, Key="p/file-s")["Body"].read() == b"through boto3's own client"
