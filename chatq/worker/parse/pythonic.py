"""Pythonic tool calls: the whole output is a Python list of calls, `[get_weather(city="Paris"), f(x=1)]`.

Arguments must be keyword literals (parsed with `ast.literal_eval`, never evaluated). Output not starting with
`[` streams at once as content. A call streams once its first argument is complete (or it closes with none): its id,
type and name, then its arguments as canonical JSON, one argument a fragment. From then on the output is calls; once
it stops being calls (text after the list, a call not read so), that is content from there on, and a call cut short
stays as far as it was written. Output that stops being calls before any call streamed is read whole at its end, as
only the whole text tells a list of calls from content that looks like one.
"""

from __future__ import annotations

import ast
from typing import Any

from chatq.core.delta import Delta, ToolCallDelta
from chatq.worker.parse import Parser
from chatq.worker.parse.common import arguments_json, new_call_id

_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


class PythonicParser(Parser):
    def __init__(self, tool_names: set[str] | None = None):
        self.tool_names = tool_names
        # head, item, name, key, eq, value, after_call, after_list; or whole (read at the end), content, dropped
        self.mode = "head"
        self.text = ""  # all the output
        self.mark = 0  # where the output not yet sent as calls starts: content from there if calls stop
        self.index = 0  # index of the next call
        self.name = self.key = self.value = ""
        self.args: dict[str, Any] = {}
        self.announced = False  # the call being read streams

    def feed(self, text: str) -> Delta:
        out = Delta()
        start = len(self.text)
        self.text += text
        for i, c in enumerate(text):
            if self.mode in ("whole", "content", "dropped"):
                break
            self._char(c, start + i, out)
        if self.mode == "content":
            out.content += self.text[self.mark :]
            self.mark = len(self.text)
        return out

    def finish(self) -> Delta:
        out = Delta()
        if self.mode in ("head", "item", "name", "key", "eq", "value") and not self.announced:
            if self.index == 0:
                self.mode = "whole"
            else:
                out.content += self.text[self.mark :]
        if self.mode == "whole":
            calls = self._parse(self.text)
            if calls:
                out.tool_calls += calls
            else:
                out.content += self.text
        self.mode = "dropped"
        return out

    def _char(self, c: str, at: int, out: Delta) -> None:
        mode = self.mode
        if mode == "value":
            self._value_char(c, at, out)
        elif c.isspace() and mode in ("head", "item", "key", "eq", "after_call", "after_list"):
            return
        elif mode == "head":
            self._to("item" if c == "[" else "content")
        elif mode in ("item", "name") and (c.isalnum() or c == "_"):
            self.mode, self.name = "name", self.name + c
        elif mode == "name" and c == "(":
            self._open_call()
        elif mode == "key" and (c.isalnum() or c == "_"):
            self.key += c
        elif mode in ("key", "eq") and c == "=" and self.key.isidentifier():
            self.mode, self.value = "value", ""
        elif mode == "key" and c == ")" and not self.key:
            self._close_call(at, out)
        elif mode == "after_call" and c == ",":
            self.mode = "item"
        elif mode in ("after_call", "item") and c == "]" and self.index > 0:
            self.mode = "after_list"
            self.mark = at + 1
        else:
            self._stop()

    def _to(self, mode: str) -> None:
        self.mode = mode
        if mode == "content":
            self.mark = 0

    def _open_call(self) -> None:
        known = self.name.isidentifier() and (self.tool_names is None or self.name in self.tool_names)
        if not known:
            self._stop()
            return
        self.mode, self.key, self.args, self.announced = "key", "", {}, False

    def _value_char(self, c: str, at: int, out: Delta) -> None:
        if c not in ",)":
            self.value += c
            return
        try:
            value = ast.literal_eval(self.value.strip())
        except _LITERAL_ERRORS:
            self.value += c  # not a whole literal yet: the comma or parenthesis is inside it
            return
        pair = arguments_json({self.key: value})
        if pair is None or self.key in self.args:
            self._stop()
            return
        self.args[self.key] = value
        self._send(("{" if len(self.args) == 1 else ", ") + pair[1:-1], out)
        self.key = ""
        if c == ")":
            self._close_call(at, out)
        else:
            self.mode = "key"

    def _send(self, fragment: str, out: Delta) -> None:
        if not self.announced:
            self.announced = True
            out.tool_calls.append(ToolCallDelta(self.index, new_call_id(), self.name))
        out.tool_calls.append(ToolCallDelta(self.index, arguments=fragment))

    def _close_call(self, at: int, out: Delta) -> None:
        self._send("}" if self.args else "{}", out)
        self.index += 1
        self.mode, self.name, self.announced = "after_call", "", False
        self.mark = at + 1

    def _stop(self) -> None:
        """The output stops being calls: dropped past a streaming call, content past a complete one; with none yet,
        the whole output is read at its end."""
        if self.announced:
            self.mode = "dropped"
        elif self.index > 0:
            self.mode = "content"
        else:
            self.mode = "whole"

    def _parse(self, text: str) -> list[ToolCallDelta] | None:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree.body, ast.List):
            return None
        calls: list[ToolCallDelta] = []
        for node in tree.body.elts:
            call = self._call(node, len(calls))
            if call is None:
                return None
            calls.append(call)
        return calls

    def _call(self, node: ast.expr, index: int) -> ToolCallDelta | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        name = node.func.id
        if self.tool_names is not None and name not in self.tool_names:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except _LITERAL_ERRORS:
                return None
        arguments = arguments_json(args)
        if arguments is None:
            return None
        return ToolCallDelta(index=index, id=new_call_id(), name=name, arguments=arguments)
