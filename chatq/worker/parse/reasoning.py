"""`<think>...</think>` reasoning (deepseek_r1 / qwen3 style) ahead of an inner content/tool-call parser."""

from __future__ import annotations

from chatq.core.delta import Delta
from chatq.worker.parse import Parser
from chatq.worker.parse.common import partial_tag_len

# The markers of a thought, for both parsers (deepseek_r1 and qwen3), as vLLM's parsers of those names write them.
THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser(Parser):
    """Text before the end tag is reasoning; text after it goes through `inner`.

    The start tag is optional because some chat templates (deepseek_r1) put it in the prompt. With no end tag
    the whole output is reasoning, unless thinking was disabled: then the model was told not to think and
    everything goes straight to `inner`.
    """

    def __init__(self, inner: Parser, *, thinking_enabled: bool = True, start: str = THINK_START, end: str = THINK_END):
        self.inner = inner
        self.start, self.end = start, end
        # "start": may still see the start tag; "reasoning": inside the thought; "content": after it.
        self.state = "start" if thinking_enabled else "content"
        self.buf = ""  # held back: a possible start tag, or a possible partial end tag

    @property
    def thinking(self) -> bool:
        return self.state != "content"

    def feed(self, text: str) -> Delta:
        if self.state == "content":
            return self.inner.feed(text)
        self.buf += text
        if self.state == "start":
            head = self.buf.lstrip()
            if len(head) < len(self.start) and self.start.startswith(head):
                return Delta()  # could still become the start tag
            if head.startswith(self.start):
                self.buf = head[len(self.start) :]
            self.state = "reasoning"
        i = self.buf.find(self.end)
        if i >= 0:
            thought, rest = self.buf[:i], self.buf[i + len(self.end) :]
            self.buf, self.state = "", "content"
            out = self.inner.feed(rest)
            out.reasoning = thought + out.reasoning
            return out
        keep = partial_tag_len(self.buf, self.end)
        thought, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return Delta(reasoning=thought)

    def finish(self) -> Delta:
        out = self.inner.finish()
        # Still thinking when generation ended: whatever was held back (a partial tag) is reasoning too.
        out.reasoning, self.buf = self.buf + out.reasoning, ""
        return out
