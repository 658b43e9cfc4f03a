"""A tool call's JSON read a piece at a time: its name once it is written, and its arguments written back as they
come, as `json.dumps(json.loads(...), ensure_ascii=False)` writes them whole.

So a call can stream: its id, type and name in one delta, then its arguments as fragments that concatenate to the
canonical JSON the non-streamed message carries.
"""

from __future__ import annotations

import json
import re

_SPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsn")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "/", "b": "\\b", "f": "\\f", "n": "\\n", "r": "\\r", "t": "\\t"}


def _written(unit: str) -> str:
    """One character of a string as canonical JSON writes it; a surrogate, which no UTF-8 encoder takes, escaped."""
    if "\ud800" <= unit <= "\udfff":
        return f"\\u{ord(unit):04x}"
    return json.dumps(unit, ensure_ascii=False)[1:-1]


class JsonReader:
    """One JSON value, read as strict `json.loads` reads it (no NaN, no control characters in strings), written back
    canonically as far as it has come. `feed` stops at the value's end: a number or literal ends at the character
    after it, which it leaves unread."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.expect = "value"  # value, key, colon, next (a comma or a close), or first_key / first_value
        self.in_string = False
        self.is_key = False
        self.escape: str | None = None  # an escape read so far, from its backslash
        self.high = ""  # a high surrogate escape waiting for its low half
        self.scalar = ""  # a number or literal read so far
        self.out: list[str] = []
        self.done = False
        self.failed = False

    def take(self) -> str:
        """The canonical text written since the last take."""
        text, self.out = "".join(self.out), []
        return text

    def feed(self, text: str) -> int:
        """Reads `text` up to the value's end, or until it fails; how many characters it read."""
        for i, c in enumerate(text):
            if self.done or self.failed:
                return i
            if self.in_string:
                self._string_char(c)
            elif self.scalar:
                if c in _SCALAR_CHARS:
                    self.scalar += c
                    continue
                self._end_scalar()
                if self.done or self.failed:
                    return i
                self._structure(c)
            else:
                self._structure(c)
        return len(text)

    def _structure(self, c: str) -> None:
        if c in _SPACE:
            return
        expect = self.expect
        if expect in ("value", "first_value"):
            if c == "]" and expect == "first_value":
                self._close("[")
            elif c in "{[":
                self.stack.append(c)
                self.out.append(c)
                self.expect = "first_key" if c == "{" else "first_value"
            elif c == '"':
                self._open_string(is_key=False)
            elif c in _SCALAR_CHARS:
                self.scalar = c
            else:
                self.failed = True
        elif expect in ("key", "first_key"):
            if c == '"':
                self._open_string(is_key=True)
            elif c == "}" and expect == "first_key":
                self._close("{")
            else:
                self.failed = True
        elif expect == "colon":
            self._colon(c)
        else:
            self._next(c)

    def _colon(self, c: str) -> None:
        if c != ":":
            self.failed = True
            return
        self.out.append(": ")
        self.expect = "value"

    def _next(self, c: str) -> None:
        if c == ",":
            self.out.append(", ")
            self.expect = "key" if self.stack[-1] == "{" else "value"
        elif c in "}]":
            self._close("{" if c == "}" else "[")
        else:
            self.failed = True

    def _close(self, opener: str) -> None:
        if not self.stack or self.stack[-1] != opener:
            self.failed = True
            return
        self.stack.pop()
        self.out.append("}" if opener == "{" else "]")
        self._value_ended()

    def _value_ended(self) -> None:
        if self.stack:
            self.expect = "next"
        else:
            self.done = True

    def _open_string(self, *, is_key: bool) -> None:
        self.in_string, self.is_key = True, is_key
        self.out.append('"')

    def _string_char(self, c: str) -> None:
        if self.escape is not None:
            self.escape += c
            self._read_escape()
        elif c == "\\":
            self.escape = "\\"
        elif c == '"':
            self._flush_high()
            self.in_string = False
            self.out.append('"')
            if self.is_key:
                self.expect = "colon"
            else:
                self._value_ended()
        elif c < " ":
            self.failed = True
        else:
            self._flush_high()
            self.out.append(_written(c))

    def _read_escape(self) -> None:
        assert self.escape is not None
        kind = self.escape[1]
        if kind != "u":
            self.escape = None
            if kind not in _ESCAPES:
                self.failed = True
                return
            self._flush_high()
            self.out.append(_ESCAPES[kind])
            return
        if len(self.escape) < 6:
            return
        digits, self.escape = self.escape[2:], None
        if not re.fullmatch(r"[0-9a-fA-F]{4}", digits):
            self.failed = True
            return
        unit = chr(int(digits, 16))
        if self.high and "\udc00" <= unit <= "\udfff":
            pair = (self.high + unit).encode("utf-16", "surrogatepass").decode("utf-16")
            self.high = ""
            self.out.append(_written(pair))
            return
        self._flush_high()
        if "\ud800" <= unit <= "\udbff":
            self.high = unit
        else:
            self.out.append(_written(unit))

    def _flush_high(self) -> None:
        if self.high:
            self.out.append(_written(self.high))
            self.high = ""

    def _end_scalar(self) -> None:
        text, self.scalar = self.scalar, ""
        if text in ("true", "false", "null"):
            self.out.append(text)
        elif _NUMBER.fullmatch(text):
            number = json.loads(text)
            if number in (float("inf"), float("-inf")):
                self.failed = True
                return
            self.out.append(json.dumps(number))
        else:
            self.failed = True
            return
        self._value_ended()


class CallReader:
    """One call written as a JSON object, `{"name": ..., "arguments"|"parameters": {...}}`, read a piece at a time.

    `name` is set once the name's string is complete; `streams` once the arguments' object has begun, from then on
    `take_arguments` gives their canonical text as it comes. `feed` stops after the object's closing brace.
    """

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.stage = "open"  # open, first_key, key, colon, value, next, closed
        self.part: JsonReader | None = None  # the key or member value being read
        self.key: str | None = None
        self.name: str | None = None
        self.arguments: JsonReader | None = None  # the arguments' object, once it begins
        self.failed = False

    @property
    def closed(self) -> bool:
        return self.stage == "closed"

    @property
    def streams(self) -> bool:
        return self.arguments is not None

    @property
    def arguments_done(self) -> bool:
        return self.arguments is not None and self.arguments.done

    def take_arguments(self) -> str:
        return self.arguments.take() if self.arguments is not None else ""

    def feed(self, text: str) -> int:
        """Reads `text` up to the object's end, or until it fails; how many characters it read."""
        i = 0
        while i < len(text) and not (self.closed or self.failed):
            if self.part is not None:
                i += self.part.feed(text[i:])
                self._read_part()
                continue
            c = text[i]
            if c not in _SPACE:
                self._structure(c)
            if self.part is None:  # a key or value reader reads its first character itself
                i += 1
        return i

    def _structure(self, c: str) -> None:
        stage = self.stage
        if stage == "open" and c == "{":
            self.stage = "first_key"
        elif stage in ("first_key", "key") and c == '"':
            self.part = JsonReader()
        elif stage in ("first_key", "next") and c == "}":
            self.stage = "closed"
        elif stage == "colon" and c == ":":
            self.stage = "value"
        elif stage == "value":
            self.part = JsonReader()
            if self.key in self.ARGUMENT_KEYS and self.arguments is None and c == "{":
                self.arguments = self.part
        elif stage == "next" and c == ",":
            self.stage = "key"
        else:
            self.failed = True

    def _read_part(self) -> None:
        part = self.part
        assert part is not None
        if part.failed:
            self.failed = True
            return
        if not part.done:
            return
        self.part = None
        if self.stage in ("first_key", "key"):
            self.key = json.loads(part.take())
            self.stage = "colon"
            return
        if part is not self.arguments:
            value = part.take()
            if self.key == "name" and self.name is None and value.startswith('"'):
                self.name = json.loads(value)
        self.stage = "next"
