"""Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated (Qwen, Hermes).

A call is emitted whole (id, name and canonical arguments in one delta) once its closing tag arrives: a call whose
JSON turns out invalid must stay content, and a streamed answer must equal the non-streamed one.
"""

from __future__ import annotations

import json

from chatq.core.delta import Delta, ToolCallDelta
from chatq.worker.parse import Parser
from chatq.worker.parse.common import call_from_json, partial_tag_len

START, END = "<tool_call>", "</tool_call>"


class HermesParser(Parser):
    def __init__(self, tool_names: set[str] | None = None):
        self.tool_names = tool_names
        self.index = 0  # index of the next call
        self.in_call = False
        self.buf = ""  # outside a call: a possible partial start tag; inside: the call so far
        # Whitespace around calls is layout: held while the gap is only whitespace, dropped if it touches a call.
        self.space = ""
        self.only_space = True

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while True:
            if self.in_call:
                i = self.buf.find(END)
                if i < 0:
                    return out
                body, self.buf = self.buf[:i], self.buf[i + len(END) :]
                self.in_call = False
                self._end_call(body, START + body + END, out)
            else:
                i = self.buf.find(START)
                if i < 0:
                    keep = partial_tag_len(self.buf, START)
                    out.content += self._text(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                out.content += self._text(self.buf[:i])
                self.buf = self.buf[i + len(START) :]
                self.in_call = True

    def finish(self) -> Delta:
        out = Delta()
        if self.in_call:  # generation ended inside a call: it still counts if its JSON is complete
            self._end_call(self.buf, START + self.buf, out)
        else:
            out.content += self._text(self.buf)
        self.buf = ""
        if not (self.only_space and self.index > 0):  # trailing whitespace after the last call is dropped
            out.content += self.space
        self.space = ""
        return out

    def _end_call(self, body: str, raw: str, out: Delta) -> None:
        call = self._parse(body)
        if call is None:
            out.content += self._text(raw)
            return
        out.tool_calls.append(call)
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
