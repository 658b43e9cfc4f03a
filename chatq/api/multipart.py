"""A multipart/form-data body read as it arrives, with python-multipart's parser: each part's name and filename,
then its data a piece at a time, so that a file part is never held whole."""

from __future__ import annotations

from dataclasses import dataclass

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from chatq.core.errors import BadRequest

# A part's headers past this many bytes are refused: they name a field and a file, nothing more.
HEADER_BYTES = 16 * 1024


@dataclass(frozen=True)
class PartStart:
    name: str
    filename: str | None  # None: a form field, not a file


@dataclass(frozen=True)
class PartData:
    data: bytes


@dataclass(frozen=True)
class PartEnd:
    pass


Event = PartStart | PartData | PartEnd


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


class FormReader:
    """Feeds the body's chunks to the parser and gives back, for each, what it held: its parts' starts, data and
    ends, in order. A body that is not multipart/form-data is a 400 naming `param`, the part the route needs."""

    def __init__(self, content_type: str | None, param: str):
        kind, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise BadRequest(f"The request must be multipart/form-data, with a `{param}` part.", param)
        self._events: list[Event] = []
        self._header: list[bytes] = [b"", b""]  # the header being read: its name, its value
        self._header_bytes = 0
        self._disposition = b""
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._begin,
                "on_header_field": lambda data, start, end: self._add(0, data[start:end]),
                "on_header_value": lambda data, start, end: self._add(1, data[start:end]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": lambda data, start, end: self._events.append(PartData(data[start:end])),
                "on_part_end": lambda: self._events.append(PartEnd()),
            },
        )

    def feed(self, chunk: bytes) -> list[Event]:
        try:
            self._parser.write(chunk)
        except MultipartParseError as e:
            raise BadRequest(f"The multipart/form-data body is malformed: {e}") from None
        events, self._events = self._events, []
        return events

    def finish(self) -> list[Event]:
        """What the body's end gave; a body cut short is a 400."""
        try:
            self._parser.finalize()
        except MultipartParseError as e:
            raise BadRequest(f"The multipart/form-data body is malformed: {e}") from None
        if self._parser.state.name != "END":
            raise BadRequest("The multipart/form-data body ended before its closing boundary.")
        events, self._events = self._events, []
        return events

    def _begin(self) -> None:
        self._header, self._header_bytes, self._disposition = [b"", b""], 0, b""

    def _add(self, which: int, data: bytes) -> None:
        self._header_bytes += len(data)
        if self._header_bytes > HEADER_BYTES:
            raise BadRequest(f"A part's headers are longer than {HEADER_BYTES} bytes.")
        self._header[which] += data

    def _header_end(self) -> None:
        if self._header[0].lower() == b"content-disposition":
            self._disposition = self._header[1]
        self._header = [b"", b""]

    def _headers_finished(self) -> None:
        kind, options = parse_options_header(self._disposition)
        if kind != b"form-data" or b"name" not in options:
            raise BadRequest("Each part of the body needs a Content-Disposition of form-data with its name.")
        filename = options.get(b"filename")
        self._events.append(PartStart(_text(options[b"name"]), None if filename is None else _text(filename)))
