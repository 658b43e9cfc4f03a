"""Tool-call parsers by name, as selected by the server's `tool_call_parser` setting."""

from __future__ import annotations

from typing import Protocol

from worker.parse import Parser
from worker.parse.common import new_call_id
from worker.parse.hermes import HermesParser
from worker.parse.llama3_json import Llama3JsonParser
from worker.parse.pythonic import PythonicParser


class ToolParserClass(Protocol):
    def __call__(self, tool_names: set[str] | None = None) -> Parser: ...


TOOL_PARSERS: dict[str, ToolParserClass] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}

__all__ = ["TOOL_PARSERS", "HermesParser", "Llama3JsonParser", "PythonicParser", "new_call_id"]
