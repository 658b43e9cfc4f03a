"""Llama 3 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`, possibly several joined
by `;`, optionally after `<|python_tag|>`.

Output that starts otherwise streams at once as content. Output that starts like a call is held until finish():
only the whole text tells calls from a JSON answer, and a streamed answer must equal the non-streamed one.
"""

from __future__ import annotations

import json

from chatq.core.delta import ToolCallDelta
from chatq.worker.parse.common import WholeOutputCalls, call_from_json

TAG = "<|python_tag|>"


class Llama3JsonParser(WholeOutputCalls):
    def could_be_call(self, text: str) -> bool:
        return could_be_call(text)

    def parse(self, text: str) -> list[ToolCallDelta] | None:
        text = text.strip()
        text = text.removeprefix(TAG)
        decoder = json.JSONDecoder()
        calls: list[ToolCallDelta] = []
        pos = skip_space(text, 0)
        while pos < len(text):
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than json's recursion limit
                return None
            call = call_from_json(obj, len(calls), self.tool_names, args_required=True)
            if call is None:
                return None
            calls.append(call)
            pos = skip_space(text, pos)
            if pos < len(text):
                if text[pos] != ";":
                    return None
                pos = skip_space(text, pos + 1)
        return calls


def could_be_call(text: str) -> bool:
    head = text.lstrip()
    if TAG.startswith(head):
        return True
    head = head.removeprefix(TAG).lstrip()
    return not head or head.startswith("{")


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
