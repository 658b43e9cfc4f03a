"""The parse stage: generated text in, message deltas out (content; reasoning and tool calls by parser).

Every parser has `feed(text) -> Delta` for each new piece of decoded text, `finish() -> Delta` once generation
ended, flushing anything held back, and `thinking`: whether it is inside a thought that has not ended (only the
reasoning parser ever is). A choice's deltas, joined field by field, equal the whole message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatq.core.delta import Delta, ToolCallDelta


class Parser:
    @property
    def thinking(self) -> bool:
        """Whether it is inside a thought whose end has not come yet (only a reasoning parser ever is)."""
        return False

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        raise NotImplementedError


class ContentParser(Parser):
    """Plain text: everything is content."""

    def feed(self, text: str) -> Delta:
        return Delta(content=text)

    def finish(self) -> Delta:
        return Delta()


@dataclass
class JoinedDeltas:
    """One choice's deltas so far, joined field by field: what its final message is made of.

    The text is kept as strings, which the cyclic garbage collector never walks, not as a Delta per token: with many
    long streams, every full collection would walk all those objects while the streams wait.
    """

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        if delta.content:
            self.content.append(delta.content)
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        self.tool_calls += delta.tool_calls

    def result(self) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(content, reasoning, tool_calls) in the OpenAI message shape.

        content is None when it is empty and there are tool calls (OpenAI's shape), reasoning None when empty.
        """
        calls: dict[int, dict[str, Any]] = {}
        for c in self.tool_calls:
            if c.index not in calls:
                function = {"name": c.name, "arguments": ""}
                calls[c.index] = {"id": c.id, "type": "function", "function": function}
            calls[c.index]["function"]["arguments"] += c.arguments
        tool_calls = [calls[i] for i in sorted(calls)]
        text = "".join(self.content)
        return (None if not text and tool_calls else text), "".join(self.reasoning) or None, tool_calls
