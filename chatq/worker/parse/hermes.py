"""Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated (Qwen, Hermes).

A call streams once its name is written and its arguments' object has begun: its id, type and name, then its
arguments as canonical fragments. From then on it is a call whatever follows: arguments cut short or gone wrong stay
as far as they were written, and the rest of the call's text is dropped. A call that never got so far (another
shape, an unknown name) is read whole at its closing tag: a call, or content if its JSON is not one.
"""

from __future__ import annotations

import json

from chatq.core.delta import Delta, ToolCallDelta
from chatq.worker.parse import Parser
from chatq.worker.parse.calls import CallReader
from chatq.worker.parse.common import call_from_json, new_call_id, partial_tag_len

START, END = "<tool_call>", "</tool_call>"


class HermesParser(Parser):
    def __init__(self, tool_names: set[str] | None = None):
        self.tool_names = tool_names
        self.index = 0  # index of the next call
        self.call: CallReader | None = None  # inside a call: its reader
        self.body = ""  # inside a call: its text read so far
        self.announced = False  # the call in progress streams
        self.buf = ""  # outside a call: a possible partial start tag; inside: a possible partial end tag
        # Whitespace around calls is layout: held while the gap is only whitespace, dropped if it touches a call.
        self.space = ""
        self.only_space = True

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while True:
            if self.call is not None:
                i = self.buf.find(END)
                if i < 0:
                    keep = partial_tag_len(self.buf, END)
                    self._read(self.buf[: len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                self._read(self.buf[:i], out)
                self.buf = self.buf[i + len(END) :]
                self._end_call(closed=True, out=out)
            else:
                i = self.buf.find(START)
                if i < 0:
                    keep = partial_tag_len(self.buf, START)
                    out.content += self._text(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                out.content += self._text(self.buf[:i])
                self.buf = self.buf[i + len(START) :]
                self.call, self.body, self.announced = CallReader(), "", False

    def finish(self) -> Delta:
        out = Delta()
        if self.call is not None:  # generation ended inside a call: it still counts if its JSON is complete
            self._read(self.buf, out)
            self._end_call(closed=False, out=out)
        else:
            out.content += self._text(self.buf)
        self.buf = ""
        if not (self.only_space and self.index > 0):  # trailing whitespace after the last call is dropped
            out.content += self.space
        self.space = ""
        return out

    def _read(self, text: str, out: Delta) -> None:
        """The call's next text: what it adds to the call's stream, once the call streams."""
        assert self.call is not None
        self.body += text
        self.call.feed(text)
        call = self.call
        if not self.announced:
            known = call.name and (self.tool_names is None or call.name in self.tool_names)
            if not (known and call.streams):
                return
            self.announced = True
            self.space, self.only_space = "", True
            out.tool_calls.append(ToolCallDelta(self.index, new_call_id(), call.name))
        fragment = call.take_arguments()
        if fragment:
            out.tool_calls.append(ToolCallDelta(self.index, arguments=fragment))

    def _end_call(self, *, closed: bool, out: Delta) -> None:
        body, self.call = self.body, None
        if self.announced:
            self.index += 1
            return
        whole = self._parse(body)
        if whole is None:
            out.content += self._text(START + body + (END if closed else ""))
            return
        out.tool_calls.append(whole)
        self.index += 1
        self.space, self.only_space = "", True

    def _parse(self, body: str) -> ToolCallDelta | None:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json's recursion limit
            return None
        return call_from_json(obj, self.index, self.tool_names, args_required=False)

    def _text(self, text: str) -> str:
        """Content to emit now, holding whitespace while the current gap between calls is only whitespace."""
        if not self.only_space:
            return text
        if not text.strip():
            self.space += text
            return ""
        text, self.space, self.only_space = self.space + text, "", False
        return text
