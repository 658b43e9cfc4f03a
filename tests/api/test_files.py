"""/v1/files through the official openai SDK, on the real API and Redis, once with the files in a directory and once
in an S3 bucket (moto's server, over HTTP): uploads read back byte for byte, lists page and filter, a delete takes
record and bytes, another key's files are not found, every bad upload is a 400 that stores nothing, and a file past
its expiry is gone, its bytes swept from the store."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from chatq.core import keys
from chatq.core.files import BATCH_EXPIRY, BATCH_LINES, MAX_EXPIRY, UPLOAD_LEASE
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import AWS_ENV, S3Server, assert_error, running_api

KEY_A, KEY_B, KEY_LISTS = "files-key-a-0123", "files-key-b-4567", "files-key-lists-89"
MAX_BYTES, MAX_BATCH_BYTES = 12 * 1024 * 1024, 64 * 1024
SWEEP = 0.2  # seconds between the API's sweeps


@dataclass
class FilesAPI:
    base: str
    settings: Settings
    r: redis.Redis
    s3: S3Server | None

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=60)

    def http(self, key: str = KEY_A) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def stored(self) -> set[str]:
        """Every name in the store, unfinished uploads' included."""
        if self.s3 is None:
            return set(os.listdir(self.settings.files_path))
        return self.s3.names(self.settings.files_s3_bucket)

    def name(self, file_id: str) -> str:
        return self.settings.files_s3_prefix + file_id if self.s3 else file_id

    def state(self) -> tuple[set[str], set[str], list[Any]]:
        """What a refused upload must leave as it was: the store, the file records, the due set."""
        records = set(self.r.scan_iter(keys.file("*")))
        return self.stored(), records, self.r.zrange(keys.files_due(), 0, -1, withscores=True)


@pytest.fixture(scope="module", params=["directory", "s3"])
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FilesAPI]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("files-redis"), persist=False).start()
    s3: S3Server | None = request.getfixturevalue("s3") if request.param == "s3" else None
    store = {"files_dir": tmp_path_factory.mktemp("files")}
    if s3 is not None:
        store = {"files_s3_bucket": s3.new_bucket(), "files_s3_endpoint_url": s3.endpoint, "files_s3_prefix": "up/"}
    settings = Settings(
        redis_url=server.url,
        api_port=free_port(),
        api_keys=f"{KEY_A},{KEY_B},{KEY_LISTS}",
        files_max_bytes=MAX_BYTES,
        files_max_batch_bytes=MAX_BATCH_BYTES,
        files_min_expiry=1,
        files_sweep_interval=SWEEP,
        **store,
    )
    try:
        with running_api(settings, tmp_path_factory.mktemp("files-logs"), AWS_ENV) as base:
            yield FilesAPI(base, settings, redis.Redis.from_url(server.url, decode_responses=True), s3)
    finally:
        server.stop()


def eventually(check: Any, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "not within the time"
        time.sleep(0.05)


def test_an_upload_reads_back_byte_for_byte(api: FilesAPI) -> None:
    client = api.client()
    data = os.urandom(10 * 1024 * 1024 + 3)  # more than a part of an S3 multipart upload
    before = int(time.time())
    made = client.files.create(file=("blob.bin", data), purpose="user_data")
    assert made.id.startswith("file-")
    assert (made.object, made.status, made.purpose) == ("file", "processed", "user_data")
    assert (made.bytes, made.filename, made.expires_at, made.status_details) == (len(data), "blob.bin", None, None)
    assert before <= made.created_at <= time.time()
    assert client.files.retrieve(made.id) == made
    assert client.files.content(made.id).content == data
    assert api.name(made.id) in api.stored()
    with api.http() as http:
        response = http.get(f"/v1/files/{made.id}/content")
        assert response.headers["content-length"] == str(len(data))


def test_a_batch_file_expires_after_30_days_unless_it_says_otherwise(api: FilesAPI) -> None:
    client = api.client()
    lines = b'{"custom_id": "1"}\n{"custom_id": "2"}'
    batch = client.files.create(file=("requests.jsonl", lines), purpose="batch")
    assert batch.expires_at == batch.created_at + BATCH_EXPIRY
    assert client.files.content(batch.id).read() == lines
    week = client.files.create(
        file=("requests.jsonl", lines), purpose="batch", expires_after={"anchor": "created_at", "seconds": 604800}
    )
    assert week.expires_at == week.created_at + 604800


def test_the_list_pages_in_either_order_and_filters_by_purpose(api: FilesAPI) -> None:
    client = api.client(KEY_LISTS)
    purposes = ["batch", "user_data", "batch", "assistants", "batch"]
    made = [
        client.files.create(file=(f"f{i}.jsonl", b"{}\n"), purpose=p).id  # type: ignore[arg-type]
        for i, p in enumerate(purposes)
    ]
    newest_first = made[::-1]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == newest_first[:2] and page.has_more
    assert (page.first_id, page.last_id) == (newest_first[0], newest_first[1])
    assert [f.id for f in client.files.list(limit=2)] == newest_first  # the SDK follows `after` to the end
    assert [f.id for f in client.files.list(limit=3, order="asc", after=made[0])] == made[1:]
    batches = [m for m, p in zip(made, purposes, strict=True) if p == "batch"]
    assert [f.id for f in client.files.list(purpose="batch", order="asc")] == batches
    last = client.files.list(purpose="batch", order="asc", after=batches[1])
    assert [f.id for f in last.data] == batches[2:] and not last.has_more
    assert client.files.list(purpose="vision").data == []
    with api.http(KEY_LISTS) as http:
        body = http.get("/v1/files", params={"limit": 10}).json()
        assert set(body) == {"object", "data", "first_id", "last_id", "has_more"} and body["object"] == "list"
        assert_error(http.get("/v1/files", params={"after": "file-gone"}), 404, "NotFoundError", "after")
        assert_error(http.get("/v1/files", params={"limit": 0}), 400, "BadRequestError", "limit")
        assert_error(http.get("/v1/files", params={"limit": 10_001}), 400, "BadRequestError", "limit")
        assert_error(http.get("/v1/files", params={"order": "up"}), 400, "BadRequestError", "order")


def test_a_delete_takes_the_record_and_the_bytes(api: FilesAPI) -> None:
    client = api.client()
    made = client.files.create(file=("gone.txt", b"soon gone"), purpose="user_data")
    deleted = client.files.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "file", True)
    assert api.name(made.id) not in api.stored()
    assert made.id not in [f.id for f in client.files.list()]
    assert api.r.zscore(keys.files_due(), made.id) is None
    with api.http() as http:
        for method, path in [("GET", ""), ("GET", "/content"), ("DELETE", "")]:
            assert_error(http.request(method, f"/v1/files/{made.id}{path}"), 404, "NotFoundError", "file_id")


def test_another_keys_file_is_not_found_and_stays(api: FilesAPI) -> None:
    mine = api.client(KEY_A).files.create(file=("mine.txt", b"private"), purpose="user_data")
    with api.http(KEY_B) as theirs:
        for method, path in [("GET", ""), ("GET", "/content"), ("DELETE", "")]:
            error = assert_error(theirs.request(method, f"/v1/files/{mine.id}{path}"), 404, "NotFoundError", "file_id")
            assert error["message"] == f"No such File object: {mine.id}"
        assert mine.id not in [f["id"] for f in theirs.get("/v1/files").json()["data"]]
        assert_error(theirs.get("/v1/files", params={"after": mine.id}), 404, "NotFoundError", "after")
        assert theirs.get("/v1/files", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert api.client(KEY_A).files.content(mine.id).content == b"private"


def multipart(*parts: tuple[str, str | None, bytes]) -> tuple[bytes, dict[str, str]]:
    """A multipart body of the parts (name, filename or None for a field, value), in this order."""
    out = bytearray()
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--b0undary\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    return bytes(out + b"--b0undary--\r\n"), {"content-type": "multipart/form-data; boundary=b0undary"}


def lines(n: int) -> bytes:
    return b"{}\n" * n


BAD_UPLOADS = {
    "no purpose": (multipart(("file", "a.jsonl", b"{}\n")), "purpose"),
    "an unknown purpose": (multipart(("purpose", None, b"training"), ("file", "a.jsonl", b"{}\n")), "purpose"),
    "purpose batch_output": (multipart(("purpose", None, b"batch_output"), ("file", "a.jsonl", b"{}\n")), "purpose"),
    "a bad purpose after the file": (multipart(("file", "a.jsonl", b"{}\n"), ("purpose", None, b"nope")), "purpose"),
    "no file part": (multipart(("purpose", None, b"batch")), "file"),
    "two file parts": (
        multipart(("purpose", None, b"batch"), ("file", "a.jsonl", b"{}\n"), ("file", "b.jsonl", b"{}\n")),
        "file",
    ),
    "a JSON body": ((b'{"purpose": "batch"}', {"content-type": "application/json"}), "file"),
    "an empty file": (multipart(("purpose", None, b"batch"), ("file", "a.jsonl", b"")), "file"),
    "a batch file not .jsonl": (multipart(("purpose", None, b"batch"), ("file", "a.json", b"{}\n")), "file"),
    "a batch file over its cap": (
        multipart(("purpose", None, b"batch"), ("file", "a.jsonl", b"x" * (MAX_BATCH_BYTES + 1))),
        "file",
    ),
    "a batch file over its cap, its purpose after it": (
        multipart(("file", "a.jsonl", b"x" * (MAX_BATCH_BYTES + 1)), ("purpose", None, b"batch")),
        "file",
    ),
    "a batch file of too many lines": (
        multipart(("purpose", None, b"batch"), ("file", "a.jsonl", b"\n" * (BATCH_LINES + 1))),
        "file",
    ),
    "a file over the cap of any file": (
        multipart(("purpose", None, b"user_data"), ("file", "a.bin", b"x" * (MAX_BYTES + 1))),
        "file",
    ),
    "an expiry too long": (
        multipart(
            ("purpose", None, b"batch"),
            ("expires_after[anchor]", None, b"created_at"),
            ("expires_after[seconds]", None, str(MAX_EXPIRY + 1).encode()),
            ("file", "a.jsonl", b"{}\n"),
        ),
        "expires_after.seconds",
    ),
    "an expiry not a number": (
        multipart(
            ("purpose", None, b"batch"),
            ("expires_after[anchor]", None, b"created_at"),
            ("expires_after[seconds]", None, b"soon"),
            ("file", "a.jsonl", b"{}\n"),
        ),
        "expires_after.seconds",
    ),
    "an expiry of another anchor": (
        multipart(
            ("purpose", None, b"batch"),
            ("expires_after[anchor]", None, b"last_active_at"),
            ("expires_after[seconds]", None, b"3600"),
            ("file", "a.jsonl", b"{}\n"),
        ),
        "expires_after.anchor",
    ),
    "an expiry without its anchor": (
        multipart(("purpose", None, b"batch"), ("expires_after[seconds]", None, b"3600"), ("file", "a.jsonl", b"x")),
        "expires_after.anchor",
    ),
    "a field too long": (
        multipart(("purpose", None, b"batch" * 1000), ("file", "a.jsonl", b"{}\n")),
        "purpose",
    ),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_a_bad_upload_is_a_400_naming_its_field_and_stores_nothing(api: FilesAPI, case: str) -> None:
    (body, headers), param = BAD_UPLOADS[case]
    before = api.state()
    with api.http() as http:
        assert_error(http.post("/v1/files", content=body, headers=headers), 400, "BadRequestError", param)
    assert api.state() == before


def test_the_sdk_gets_openais_error_for_a_bad_upload(api: FilesAPI) -> None:
    before = api.state()
    with pytest.raises(openai.BadRequestError) as refused:
        api.client().files.create(
            file=("a.jsonl", b"{}\n"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 0}
        )
    assert refused.value.body["param"] == "expires_after.seconds"  # type: ignore[index]
    assert api.state() == before


def leases(api: FilesAPI, before: tuple[set[str], set[str], list[Any]]) -> set[str]:
    """The ids the due set holds that it did not hold `before`: uploads under way."""
    return set(api.r.zrange(keys.files_due(), 0, -1)) - {member for member, _ in before[2]}


def test_an_upload_whose_client_goes_away_stores_nothing(api: FilesAPI) -> None:
    before = api.state()
    head, _ = multipart(("purpose", None, b"user_data"), ("file", "a.bin", b""))
    start = head[: head.index(b"\r\n--b0undary--")]  # the file part opened, never closed
    host, port = api.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY_A}\r\n"
            f"Content-Type: multipart/form-data; boundary=b0undary\r\nContent-Length: {10**8}\r\n\r\n".encode()
            + start
            + os.urandom(3 * 1024 * 1024)
        )
        eventually(lambda: leases(api, before))  # the upload under way holds a lease
    eventually(lambda: api.state() == before)


def test_a_file_past_its_expiry_is_gone_and_its_bytes_swept(api: FilesAPI) -> None:
    client = api.client()
    made = client.files.create(
        file=("brief.txt", b"short-lived"), purpose="user_data", expires_after={"anchor": "created_at", "seconds": 2}
    )
    assert made.expires_at == made.created_at + 2
    assert client.files.content(made.id).content == b"short-lived"
    eventually(lambda: time.time() >= made.created_at + 2)
    with api.http() as http:
        for path in ("", "/content"):
            assert_error(http.get(f"/v1/files/{made.id}{path}"), 404, "NotFoundError", "file_id")
    assert made.id not in [f.id for f in client.files.list()]
    eventually(lambda: api.name(made.id) not in api.stored())
    assert not api.r.exists(keys.file(made.id)) and api.r.zscore(keys.files_due(), made.id) is None


def test_the_sweep_deletes_what_a_process_that_died_left(api: FilesAPI, tmp_path: Path) -> None:
    """Bytes stored by an upload whose API died before it recorded them, and a deleted file's bytes whose deleter
    died: each is due, and the sweep deletes it."""
    store = api.settings.files_path if api.s3 is None else None
    for file_id, due in [("file-crashedupload", time.time() - UPLOAD_LEASE), ("file-crasheddelete", 0)]:
        if store is not None:
            (store / file_id).write_bytes(b"left behind")
        else:
            assert api.s3 is not None
            api.s3.client().put_object(Bucket=api.settings.files_s3_bucket, Key=api.name(file_id), Body=b"left")
        api.r.zadd(keys.files_due(), {file_id: due})
    eventually(lambda: not {api.name("file-crashedupload"), api.name("file-crasheddelete")} & api.stored())
    eventually(lambda: api.r.zscore(keys.files_due(), "file-crasheddelete") is None)


def test_an_upload_whose_lease_ran_out_is_a_408_and_stores_nothing(api: FilesAPI) -> None:
    before = api.state()
    body, headers = multipart(("purpose", None, b"user_data"), ("file", "a.bin", os.urandom(2 * 1024 * 1024)))
    resume = threading.Event()

    def halves() -> Iterator[bytes]:
        yield body[: len(body) // 2]
        resume.wait(30)
        yield body[len(body) // 2 :]

    with api.http() as http, ThreadPoolExecutor(1) as pool:
        sent = pool.submit(http.post, "/v1/files", content=halves(), headers=headers)
        eventually(lambda: leases(api, before))
        (file_id,) = leases(api, before)
        api.r.zadd(keys.files_due(), {file_id: time.time() - 1})  # as after 10 minutes without a byte
        resume.set()
        assert_error(sent.result(timeout=30), 408, "RequestTimeoutError", None)
    eventually(lambda: api.state() == before)


FILE_ROUTES = [
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/file-x"),
    ("GET", "/v1/files/file-x/content"),
    ("DELETE", "/v1/files/file-x"),
]


@pytest.mark.parametrize(("method", "path"), FILE_ROUTES)
def test_every_files_route_needs_a_key_and_an_upload_without_one_stores_nothing(
    api: FilesAPI, method: str, path: str
) -> None:
    before = api.state()
    body, headers = multipart(("purpose", None, b"user_data"), ("file", "a.txt", b"not read"))
    with httpx.Client(base_url=api.base) as http:
        for auth in ({}, {"Authorization": "Bearer wrong-key"}):
            sent = http.request(method, path, content=body if method == "POST" else None, headers=headers | auth)
            assert_error(sent, 401, "AuthenticationError", None)
    assert api.state() == before
