"""What the parse stage makes of each piece of generated text, and what the chunks are built from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set, with name, on a call's first delta only
    name: str | None = None
    arguments: str = ""  # a fragment; the fragments of one call concatenate to its JSON arguments


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __add__(self, later: Delta) -> Delta:
        """This delta followed by `later`, as one."""
        return Delta(self.content + later.content, self.reasoning + later.reasoning, self.tool_calls + later.tool_calls)
