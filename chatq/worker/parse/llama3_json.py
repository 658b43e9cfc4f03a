"""Llama 3 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`, possibly several joined
by `;`, optionally after `<|python_tag|>`.

Output that starts otherwise streams at once as content. Output that starts like a call is held until a call is
sure: its name is one of the request's tools and its arguments' object has begun. From then on the output is calls,
each streaming its id, type and name, then its arguments as canonical fragments; arguments cut short or gone wrong
stay as far as they were written, and the rest of the output is dropped. A call that never got so far is read whole
once its object ends. Output that stops being calls (other text after a call, JSON that is no call) is content from
there on, and all of it when no call came before.
"""

from __future__ import annotations

import json

from chatq.core.delta import Delta, ToolCallDelta
from chatq.worker.parse import Parser
from chatq.worker.parse.calls import CallReader
from chatq.worker.parse.common import call_from_json, new_call_id

TAG = "<|python_tag|>"


class Llama3JsonParser(Parser):
    def __init__(self, tool_names: set[str] | None = None):
        self.tool_names = tool_names
        self.mode = "head"  # head, call, between, content, dropped
        self.held = ""  # text not sent yet that comes before the call being read: the head, or a separator
        self.call: CallReader | None = None
        self.segment = ""  # the text of the call being read
        self.announced = False
        self.index = 0  # index of the next call

    def feed(self, text: str) -> Delta:
        out = Delta()
        while text and self.mode not in ("content", "dropped"):
            if self.mode == "head":
                text = self._head(text, out)
            elif self.mode == "call":
                text = self._read(text, out)
            else:
                text = self._between(text, out)
        if self.mode == "content":
            out.content += text
        return out

    def finish(self) -> Delta:
        out = Delta()
        if self.mode == "head":
            out.content += self.held
        elif self.mode == "call":
            self._end_call(out)
        self.mode = "dropped"
        return out

    def _head(self, text: str, out: Delta) -> str:
        """Holds the output while it may still start a call; the text a call's reader is to read, if one starts."""
        self.held += text
        head = self.held.lstrip()
        if TAG.startswith(head):
            return ""
        rest = head.removeprefix(TAG).lstrip()
        if not rest:
            return ""
        if not rest.startswith("{"):
            self._not_calls(out)
            return ""
        at = len(self.held) - len(rest)
        self.held, text = self.held[:at], self.held[at:]
        self._start_call()
        return text

    def _start_call(self) -> None:
        self.mode, self.call, self.segment, self.announced = "call", CallReader(), "", False

    def _read(self, text: str, out: Delta) -> str:
        """Reads the call's text up to its object's end; what follows."""
        call = self.call
        assert call is not None
        n = call.feed(text)
        self.segment += text[:n]
        if not self.announced and call.name is not None and call.streams and self._known(call.name):
            self.announced, self.held = True, ""
            out.tool_calls.append(ToolCallDelta(self.index, new_call_id(), call.name))
        if self.announced:
            fragment = call.take_arguments()
            if fragment:
                out.tool_calls.append(ToolCallDelta(self.index, arguments=fragment))
            if call.failed:
                self.mode = "dropped"
        elif call.failed or (call.name is not None and not self._known(call.name)):
            self._not_calls(out)
            return text[n:]
        if call.closed:
            self._end_call(out)
        return text[n:]

    def _known(self, name: str) -> bool:
        return bool(name) and (self.tool_names is None or name in self.tool_names)

    def _end_call(self, out: Delta) -> None:
        """The call's object ended, or the output did: the call, read whole if it was not streaming."""
        if not self.announced:
            whole = self._parse(self.segment)
            if whole is None:
                self._not_calls(out)
                return
            out.tool_calls.append(whole)
        self.index += 1
        self.mode, self.held = "between", ""

    def _parse(self, text: str) -> ToolCallDelta | None:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json's recursion limit
            return None
        return call_from_json(obj, self.index, self.tool_names, args_required=True)

    def _between(self, text: str, out: Delta) -> str:
        """After a call: whitespace, one `;` and the next call's start are layout; anything else is content."""
        for i, c in enumerate(text):
            if c.isspace() or (c == ";" and ";" not in self.held):
                self.held += c
            elif c == "{" and ";" in self.held:
                self._start_call()
                return text[i:]
            else:
                self._not_calls(out)
                return text[i:]
        return ""

    def _not_calls(self, out: Delta) -> None:
        """The output stops being calls here: what was held, and all that follows, is content."""
        out.content += self.held + (self.segment if self.mode == "call" else "")
        self.mode, self.held, self.segment = "content", "", ""
