"""A file upload (POST /v1/files): its form fields checked as OpenAI checks them, and its file part streamed into the
store as it arrives, its bytes and lines counted and its caps enforced on the way, so that no upload is held whole
in memory and a refused one stops where it broke a rule."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from chatq.api.multipart import Event, FormReader, PartData, PartEnd, PartStart
from chatq.core.errors import BadRequest
from chatq.core.files import BATCH_LINES, BATCH_OUTPUT, MAX_EXPIRY, Purpose
from chatq.core.filestore import FileStore, Writer
from chatq.core.settings import Settings

# A form field's value past this many bytes is refused, as are fields past this many: they are short words.
FIELD_BYTES = 1024
FIELDS = 32
# Bytes of the file gathered before each write to the store, off the event loop.
WRITE_BYTES = 1024 * 1024
# Seconds between two lengthenings of the upload's lease while its bytes arrive.
TOUCH_EVERY = 30.0
# A field named as the openai SDK sends a nested one: expires_after[seconds].
NESTED = re.compile(r"(\w+)\[(\w+)\]")


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int

    @field_validator("seconds")
    @classmethod
    def _within_bounds(cls, seconds: int, info: ValidationInfo) -> int:
        shortest = (info.context or {}).get("min_expiry", 3600)
        if not shortest <= seconds <= MAX_EXPIRY:
            raise ValueError(f"must be between {shortest} and {MAX_EXPIRY}")
        return seconds


class UploadForm(BaseModel):
    """The upload's fields other than the file."""

    purpose: Purpose
    expires_after: ExpiresAfter | None = None

    @field_validator("purpose", mode="before")
    @classmethod
    def _not_ours(cls, purpose: Any) -> Any:
        if purpose == BATCH_OUTPUT:
            raise ValueError(f"Files of purpose '{BATCH_OUTPUT}' are written by chatq only, as a batch's results")
        return purpose


def _nested(fields: dict[str, str]) -> dict[str, Any]:
    """The form's fields as an object: `expires_after[seconds]` becomes `expires_after.seconds`."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if (m := NESTED.fullmatch(name)) is not None:
            inner = out.setdefault(m[1], {})
            if isinstance(inner, dict):
                inner[m[2]] = value
        else:
            out[name] = value
    return out


def check_form(fields: dict[str, str], settings: Settings) -> UploadForm:
    """The form, or a 400 naming the field that is wrong."""
    try:
        return UploadForm.model_validate(_nested(fields), context={"min_expiry": settings.files_min_expiry})
    except pydantic.ValidationError as e:
        raise RequestValidationError([err | {"loc": ("body", *err["loc"])} for err in e.errors()]) from None


@dataclass(frozen=True)
class Received:
    form: UploadForm
    filename: str
    bytes: int
    lines: int


class Upload:
    """One request's upload into the store under `name`. `touch` lengthens its lease; it is awaited every
    TOUCH_EVERY seconds while the file arrives."""

    def __init__(self, store: FileStore, name: str, settings: Settings, touch: Callable[[], Awaitable[None]]):
        self.store, self.name, self.settings, self.touch = store, name, settings, touch
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.part: str | None = None  # the name of the part being read: "file", a field's, or "" for one skipped
        self.value = bytearray()
        self.writer: Writer | None = None
        self.buffer = bytearray()
        self.size = self.newlines = 0
        self.last = b""
        self.touched = time.monotonic()

    async def read(self, request: Request) -> Received:
        """Reads the body into the store; the file stays uncommitted, and is aborted, if any rule is broken."""
        reader = FormReader(request.headers.get("content-type"), "file")
        try:
            async for chunk in request.stream():
                await self._handle(reader.feed(chunk))
            await self._handle(reader.finish())
            return await self._received()
        except BaseException:
            if self.writer is not None:
                await asyncio.to_thread(self.writer.abort)
            raise

    async def _handle(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, PartStart):
                await self._start(event)
            elif isinstance(event, PartData):
                await self._data(event.data)
            elif isinstance(event, PartEnd):
                await self._end()

    async def _start(self, part: PartStart) -> None:
        if part.name == "file":
            if self.filename is not None:
                raise BadRequest("Upload one file a request: the body has two `file` parts.", "file")
            if "purpose" in self.fields:  # a bad form stops the upload before any of the file is stored
                check_form(self.fields, self.settings)
            self.filename = part.filename or ""
            self.writer = await asyncio.to_thread(self.store.create, self.name)
        elif part.filename is None and len(self.fields) >= FIELDS:
            raise BadRequest(f"The form has more than {FIELDS} fields.")
        self.part = part.name if part.name == "file" or part.filename is None else ""
        self.value.clear()

    async def _data(self, data: bytes) -> None:
        if self.part == "file":
            await self._file_data(data)
        elif self.part:
            self.value += data
            if len(self.value) > FIELD_BYTES:
                raise BadRequest(f"The field `{self.part}` is longer than {FIELD_BYTES} bytes.", self.part)

    async def _end(self) -> None:
        if self.part == "file":
            await self._flush()
        elif self.part:
            self.fields[self.part] = self.value.decode("utf-8", errors="replace")
        self.part = None

    async def _file_data(self, data: bytes) -> None:
        self.size += len(data)
        self.newlines += data.count(b"\n")
        self.last = data[-1:] or self.last
        self._check_size()
        self.buffer += data
        if len(self.buffer) >= WRITE_BYTES:
            await self._flush()
        if time.monotonic() - self.touched > TOUCH_EVERY:
            await self.touch()
            self.touched = time.monotonic()

    async def _flush(self) -> None:
        if self.writer is not None and self.buffer:
            data, self.buffer = bytes(self.buffer), bytearray()
            await asyncio.to_thread(self.writer.write, data)

    @property
    def lines(self) -> int:
        return self.newlines + (1 if self.size and self.last != b"\n" else 0)

    def _check_size(self) -> None:
        """The caps of the file's purpose, as far as the fields read so far tell it."""
        batch = self.fields.get("purpose") == "batch"
        cap = self.settings.files_max_batch_bytes if batch else self.settings.files_max_bytes
        if self.size > cap:
            what = "a batch input file" if batch else "a file"
            raise BadRequest(f"The file is larger than {cap} bytes, the most {what} may hold.", "file")
        if batch and self.lines > BATCH_LINES:
            raise BadRequest(f"A batch input file holds at most {BATCH_LINES} lines (requests).", "file")

    async def _received(self) -> Received:
        if self.filename is None or self.writer is None:
            raise BadRequest("Missing required parameter: 'file'.", "file")
        form = check_form(self.fields, self.settings)
        self._check_size()
        if self.size == 0:
            raise BadRequest("The file is empty.", "file")
        if form.purpose == "batch" and not self.filename.lower().endswith(".jsonl"):
            raise BadRequest("A batch input file must be a .jsonl file (JSON Lines): one request a line.", "file")
        await self._flush()
        # A lease that ran out may have had its bytes swept meanwhile: refused here, and lengthened otherwise, so
        # that no sweep takes them while they are committed and recorded.
        await self.touch()
        await asyncio.to_thread(self.writer.commit)
        return Received(form, self.filename, self.size, self.lines)
