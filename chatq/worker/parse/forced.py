"""Tool calls forced by tool_choice: the grammar fixes the output's shape, so parsing is direct.

Named: the whole output is that function's arguments, streamed as argument fragments behind one id and name.
Required: the output is a JSON array of {"name", "parameters"} objects, read once it is complete.
"""

from __future__ import annotations

import json

from chatq.core.delta import Delta, ToolCallDelta
from chatq.worker.parse import Parser
from chatq.worker.parse.common import arguments_json, new_call_id


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
        try:
            items = json.loads(self.text)
            calls = []
            for i, item in enumerate(items):
                args = arguments_json(item["parameters"])
                if not isinstance(item["name"], str) or args is None:
                    raise ValueError("not a call")
                calls.append(ToolCallDelta(i, new_call_id(), item["name"], args))
        except (ValueError, TypeError, KeyError, RecursionError):
            # Only a generation cut short (max_tokens) leaves the array unfinished: keep the text, as content.
            return Delta(content=self.text)
        return Delta(tool_calls=calls)
