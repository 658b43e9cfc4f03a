"""Tool calls forced by tool_choice: the grammar fixes the output's shape, so parsing is direct.

Named: the whole output is that function's arguments, streamed as argument fragments behind one id and name.
Required: the output is a JSON array of {"name", "parameters"} objects; each call streams once its name is written
and its parameters have begun, its arguments as canonical fragments.
"""

from __future__ import annotations

import json

from chatq.core.delta import Delta, ToolCallDelta
from chatq.worker.parse import Parser
from chatq.worker.parse.calls import CallReader
from chatq.worker.parse.common import call_from_json, new_call_id


class NamedToolParser(Parser):
    def __init__(self, name: str):
        self.name = name
        self.started = False

    def feed(self, text: str) -> Delta:
        out = Delta()
        if not self.started:
            self.started = True
            out.tool_calls.append(ToolCallDelta(0, new_call_id(), self.name))
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> Delta:
        return Delta() if self.started else self.feed("")


class RequiredToolParser(Parser):
    """A generation cut short (max_tokens) ends the array early: the call it was writing stays as far as it was
    written; one whose name was not complete is not sent. With no call sent, the text is all there is, as content."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = "head"  # head, item, call, after, end
        self.call: CallReader | None = None
        self.segment = ""
        self.announced = False
        self.index = 0  # index of the next call

    def feed(self, text: str) -> Delta:
        self.text += text
        out = Delta()
        while text and self.mode != "end":
            if self.mode == "call":
                text = self._read(text, out)
                continue
            c, text = text[0], text[1:]
            if c.isspace():
                continue
            if self.mode == "head" and c == "[":
                self.mode = "item"
            elif self.mode == "item" and c == "{":
                self.mode, self.call, self.segment, self.announced = "call", CallReader(), "", False
                text = c + text
            elif self.mode == "after" and c == ",":
                self.mode = "item"
            else:
                self.mode = "end"  # "]", or no array of calls
        return out

    def finish(self) -> Delta:
        out = Delta()
        if self.mode == "call" and self.announced:
            self.index += 1
        self.mode = "end"
        return out if self.index else Delta(content=self.text)

    def _read(self, text: str, out: Delta) -> str:
        call = self.call
        assert call is not None
        n = call.feed(text)
        self.segment += text[:n]
        if not self.announced and call.name and call.streams:
            self.announced = True
            out.tool_calls.append(ToolCallDelta(self.index, new_call_id(), call.name))
        if self.announced:
            fragment = call.take_arguments()
            if fragment:
                out.tool_calls.append(ToolCallDelta(self.index, arguments=fragment))
        if call.failed:
            self.mode = "end"
        elif call.closed:
            self._end_call(out)
        return text[n:]

    def _end_call(self, out: Delta) -> None:
        if not self.announced:
            whole = call_from_json(json.loads(self.segment), self.index, None, args_required=True)
            if whole is None:
                self.mode = "end"
                return
            out.tool_calls.append(whole)
        self.index += 1
        self.mode = "after"
