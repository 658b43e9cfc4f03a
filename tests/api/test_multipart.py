"""The multipart/form-data reader: the same parts however the body's chunks fall, and a 400 for a body that is not
multipart/form-data or is malformed."""

from __future__ import annotations

import httpx
import pytest

from chatq.api.multipart import HEADER_BYTES, Event, FormReader, PartData, PartEnd, PartStart
from chatq.core.errors import BadRequest

FILE = b'{"custom_id": "a"}\r\n--not-the-boundary\n' * 50


def body() -> tuple[bytes, str]:
    """A body as the openai SDK sends an upload (httpx's multipart)."""
    request = httpx.Request(
        "POST",
        "http://test/v1/files",
        data={"purpose": "batch", "expires_after[seconds]": "3600"},
        files={"file": ("requests.jsonl", FILE)},
    )
    return request.read(), request.headers["content-type"]


def parts(events: list[Event]) -> list[tuple[str, str | None, bytes]]:
    """The events as (name, filename, data) a part."""
    out: list[tuple[str, str | None, bytes]] = []
    data = bytearray()
    for event in events:
        if isinstance(event, PartStart):
            start, data = event, bytearray()
        elif isinstance(event, PartData):
            data += event.data
        elif isinstance(event, PartEnd):
            out.append((start.name, start.filename, bytes(data)))
    return out


def read(raw: bytes, content_type: str, size: int) -> list[Event]:
    reader = FormReader(content_type, "file")
    events: list[Event] = []
    for i in range(0, len(raw), size):
        events += reader.feed(raw[i : i + size])
    return events + reader.finish()


@pytest.mark.parametrize("size", [1, 2, 7, 64, 1000, 10**6])
def test_the_parts_are_the_same_however_the_chunks_fall(size: int) -> None:
    raw, content_type = body()
    assert parts(read(raw, content_type, size)) == [
        ("purpose", None, b"batch"),
        ("expires_after[seconds]", None, b"3600"),
        ("file", "requests.jsonl", FILE),
    ]


@pytest.mark.parametrize("content_type", [None, "application/json", "multipart/form-data", "text/plain; boundary=x"])
def test_a_body_that_is_not_multipart_form_data_names_the_part_the_route_needs(content_type: str | None) -> None:
    with pytest.raises(BadRequest) as refused:
        FormReader(content_type, "file")
    assert refused.value.param == "file" and "multipart/form-data" in refused.value.message


def test_a_body_cut_short_is_refused() -> None:
    raw, content_type = body()
    with pytest.raises(BadRequest, match="closing boundary"):
        read(raw[: len(raw) // 2], content_type, 100)


@pytest.mark.parametrize(
    "raw",
    [
        b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--\r\n",  # no Content-Disposition
        b'--b\r\nContent-Disposition: attachment; filename="x"\r\n\r\nx\r\n--b--\r\n',  # not form-data
        b"--b\r\nContent-Disposition: form-data; name=" + b"n" * HEADER_BYTES + b"\r\n\r\nx\r\n--b--\r\n",
        b"--b\r\nno colon in this header\r\n\r\nx\r\n--b--\r\n",
        b"garbage before any boundary",
    ],
)
def test_a_malformed_body_is_refused(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        read(raw, "multipart/form-data; boundary=b", 16)
