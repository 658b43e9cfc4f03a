"""Pythonic tool calls: the whole output is a Python list of calls, `[get_weather(city="Paris"), f(x=1)]`.

Arguments must be keyword literals (parsed with `ast.literal_eval`, never evaluated). Output not starting with
`[` streams at once as content; output that does is held until finish(), as only the whole text tells a list of
calls from content that looks like one.
"""

from __future__ import annotations

import ast
from typing import Any

from chatq.core.delta import ToolCallDelta
from chatq.worker.parse.common import WholeOutputCalls, arguments_json, new_call_id


class PythonicParser(WholeOutputCalls):
    def could_be_call(self, text: str) -> bool:
        head = text.lstrip()
        return not head or head.startswith("[")

    def parse(self, text: str) -> list[ToolCallDelta] | None:
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
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        arguments = arguments_json(args)
        if arguments is None:
            return None
        return ToolCallDelta(index=index, id=new_call_id(), name=name, arguments=arguments)
