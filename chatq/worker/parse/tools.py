"""Tool-call parsers by name, as CHATQ_TOOL_PARSER (Settings.tool_parser) names them."""

from __future__ import annotations

from typing import Protocol

from chatq.core.delta import Delta
from chatq.worker.parse import Parser
from chatq.worker.parse.hermes import HermesParser
from chatq.worker.parse.llama3_json import Llama3JsonParser
from chatq.worker.parse.pythonic import PythonicParser


class ToolParserClass(Protocol):
    def __call__(self, tool_names: set[str] | None = None) -> Parser: ...


TOOL_PARSERS: dict[str, ToolParserClass] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}


class FirstCallOnly(Parser):
    """parallel_tool_calls=false under tool_choice "auto": the model's first call is kept and any later one dropped,
    as vLLM does; a tool parser itself accepts however many the model writes."""

    def __init__(self, inner: Parser):
        self.inner = inner

    def feed(self, text: str) -> Delta:
        return self._first(self.inner.feed(text))

    def finish(self) -> Delta:
        return self._first(self.inner.finish())

    @staticmethod
    def _first(delta: Delta) -> Delta:
        delta.tool_calls = [c for c in delta.tool_calls if c.index == 0]
        return delta
