"""Tool calls forced by tool_choice: the grammar fixes the output's shape, so parsing is direct.

Named: the whole output is that function's arguments, streamed as argument fragments behind one id and name.
Required: the output is a JSON array of {"name", "parameters"} objects, read once it ends.
"""

from __future__ import annotations

import json
from typing import Any

from chatq.core.delta import Delta, ToolCallDelta
from chatq.worker.parse import Parser
from chatq.worker.parse.common import call_from_json, new_call_id


class NamedToolParser(Parser):
    def __init__(self, name: str):
        self.name = name
        self.started = False

    def feed(self, text: str) -> Delta:
        if not self.started:
            self.started = True
            return Delta(tool_calls=[ToolCallDelta(0, new_call_id(), self.name, text)])
        return Delta(tool_calls=[ToolCallDelta(0, arguments=text)]) if text else Delta()

    def finish(self) -> Delta:
        return Delta() if self.started else self.feed("")


class RequiredToolParser(Parser):
    def __init__(self) -> None:
        self.text = ""

    def feed(self, text: str) -> Delta:
        self.text += text
        return Delta()

    def finish(self) -> Delta:
        calls = [call_from_json(item, i, None, args_required=True) for i, item in enumerate(_complete_items(self.text))]
        # A generation cut short (max_tokens) ends the array early: its complete calls are kept, the one it was
        # writing dropped. With none complete, the text is all there is, as content.
        if not calls or None in calls:
            return Delta(content=self.text)
        return Delta(tool_calls=[c for c in calls if c is not None])


def _complete_items(text: str) -> list[Any]:
    """The items of a JSON array that were written whole, up to where `text` ends (the grammar's compact layout)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    at = text.find("[") + 1
    if not at or text[:at].strip() != "[":
        return []
    while True:
        while at < len(text) and text[at] in " \n\t\r,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return items
        items.append(item)
