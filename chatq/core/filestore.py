"""Where the files' bytes live: a directory every process reaches, or an S3-compatible bucket (through boto3). A
store holds bytes by name only; what a file is (its owner, purpose, expiry) is its record in Redis
(chatq.core.files).

Every method blocks: the API calls them in threads, a worker's batch runner from its own.
"""

from __future__ import annotations

import contextlib
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from chatq.core.settings import Settings

# Bytes read from a store at a time.
CHUNK = 1024 * 1024
# Bytes of each part of an S3 multipart upload: S3 takes parts of 5 MiB and more (the last one excepted), at most
# 10,000 of them, so 8 MiB parts hold files up to 78 GiB.
S3_PART = 8 * 1024 * 1024
# Names are file ids: a name of other characters, or a leading dot, could reach outside the store's directory.
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")


class StoredFileMissing(LookupError):
    """The store holds nothing under the name."""


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


class Writer(ABC):
    """A file being written: its bytes appear under its name only once committed, and an abort (or leaving the
    `with` block by an exception) leaves nothing behind."""

    @abstractmethod
    def write(self, data: bytes) -> None: ...

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.abort()


class FileStore(ABC):
    @abstractmethod
    def create(self, name: str) -> Writer:
        """A writer of the file `name`, which replaces any file of that name when committed."""

    @abstractmethod
    def open(self, name: str) -> Readable:
        """The file's bytes, to read and close; StoredFileMissing if there is none."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Deletes the file, and what an unfinished writer of it left; nothing if there is none."""

    def put(self, name: str, chunks: Iterable[bytes]) -> int:
        """Writes the file from its chunks; its size."""
        size = 0
        with self.create(name) as writer:
            for chunk in chunks:
                writer.write(chunk)
                size += len(chunk)
            writer.commit()
        return size

    def lines(self, name: str) -> Iterator[bytes]:
        """The file's lines, without their line ends (`\\n`, or `\\r\\n`); a last line without one is a line too."""
        line = bytearray()  # grown in place: a line may span many chunks
        for chunk in chunks(self.open(name)):
            start = 0
            while (end := chunk.find(b"\n", start)) != -1:
                line += chunk[start:end]
                yield bytes(line).removesuffix(b"\r")
                line.clear()
                start = end + 1
            line += chunk[start:]
        if line:
            yield bytes(line).removesuffix(b"\r")


def chunks(f: Readable) -> Iterator[bytes]:
    """An opened file's bytes, a chunk at a time; closed at the end."""
    try:
        while chunk := f.read(CHUNK):
            yield chunk
    finally:
        f.close()


def _checked(name: str) -> str:
    if NAME.fullmatch(name) is None:
        raise ValueError(f"{name!r} is not a file store name")
    return name


class LocalStore(FileStore):
    """A directory: on one machine the API and the workers share it; on several, a shared file system (NFS, a
    Kubernetes ReadWriteMany volume) mounted at the same path."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.root / _checked(name)

    def _partial(self, name: str) -> Path:
        # A dot file beside the file: listing the directory shows only whole files, and delete finds it by name.
        return self.root / f".{_checked(name)}.part"

    def create(self, name: str) -> Writer:
        return _LocalWriter(self._partial(name), self._path(name))

    def open(self, name: str) -> Readable:
        try:
            return self._path(name).open("rb")
        except FileNotFoundError:
            raise StoredFileMissing(name) from None

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)
        self._partial(name).unlink(missing_ok=True)


class _LocalWriter(Writer):
    def __init__(self, partial: Path, final: Path):
        self.partial, self.final = partial, final
        self.f = partial.open("wb")

    def write(self, data: bytes) -> None:
        self.f.write(data)

    def commit(self) -> None:
        # On disk before it is renamed, so a crash never leaves a named file that is short.
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.partial, self.final)

    def abort(self) -> None:
        self.f.close()
        self.partial.unlink(missing_ok=True)


class S3Store(FileStore):
    """A bucket of AWS S3 or any S3-compatible store, through boto3: credentials and region as boto3 finds them (the
    standard AWS variables, a profile, an instance role)."""

    def __init__(self, bucket: str, endpoint_url: str = "", prefix: str = "", client: Any = None):
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix
        self.client = client or boto3.client(
            "s3", endpoint_url=endpoint_url or None, config=Config(retries={"mode": "standard", "max_attempts": 5})
        )

    def key(self, name: str) -> str:
        return self.prefix + _checked(name)

    def create(self, name: str) -> Writer:
        return _S3Writer(self.client, self.bucket, self.key(name))

    def open(self, name: str) -> Readable:
        try:
            body: Readable = self.client.get_object(Bucket=self.bucket, Key=self.key(name))["Body"]
        except self.client.exceptions.NoSuchKey:
            raise StoredFileMissing(name) from None
        return body

    def delete(self, name: str) -> None:
        # S3 answers a delete of a missing key as of one it held; an unfinished multipart upload is aborted by its
        # writer, or by the bucket's lifecycle rule for those (docs/batches.md#files).
        self.client.delete_object(Bucket=self.bucket, Key=self.key(name))


class _S3Writer(Writer):
    """One PUT for a file of less than a part, else a multipart upload of S3_PART parts: never more than a part in
    memory."""

    def __init__(self, client: Any, bucket: str, key: str):
        self.client, self.bucket, self.key = client, bucket, key
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []

    def write(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= S3_PART:
            self._part(bytes(self.buffer[:S3_PART]))
            del self.buffer[:S3_PART]

    def _part(self, data: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        number = len(self.parts) + 1
        done = self.client.upload_part(
            Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=data
        )
        self.parts.append({"PartNumber": number, "ETag": done["ETag"]})

    def commit(self) -> None:
        if self.upload_id is None:
            self.client.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self.buffer))
            return
        if self.buffer:
            self._part(bytes(self.buffer))
        self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}
        )

    def abort(self) -> None:
        self.buffer.clear()
        if self.upload_id is not None:
            with contextlib.suppress(Exception):  # the upload is left to the bucket's lifecycle rule
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)


def file_store(settings: Settings) -> FileStore:
    """The store the settings name: their bucket if one is set, else their directory."""
    if settings.files_s3_bucket:
        return S3Store(settings.files_s3_bucket, settings.files_s3_endpoint_url, settings.files_s3_prefix)
    return LocalStore(settings.files_path)
