"""Small helpers shared by the parsers: held-back tag prefixes, call ids and canonical tool-call deltas."""

from __future__ import annotations

import json
import uuid
from typing import Any

from chatq.core.delta import ToolCallDelta


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`.

    That many characters must be held back: the next piece of text may complete the tag.
    """
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def arguments_json(arguments: dict[str, Any]) -> str | None:
    """The canonical JSON of a call's arguments, or None when they have no JSON form (NaN, sets, bytes...)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    try:
        text.encode()
    except UnicodeEncodeError:
        # A lone surrogate the model wrote as an escape ("\ud83d") decodes to a string no UTF-8 encoder takes,
        # failing the step's Redis writes; escaped, it is the same JSON value.
        return json.dumps(arguments, allow_nan=False)
    return text


def call_from_json(obj: Any, index: int, tool_names: set[str] | None, *, args_required: bool) -> ToolCallDelta | None:
    """A `{"name": ..., "arguments"|"parameters": {...}}` object as a complete call, or None if it is not one.

    `args_required` is for formats without tags around the call, where a bare `{"name": ...}` is more
    likely ordinary JSON content than a call.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    elif args_required:
        return None
    else:
        args = {}
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    if tool_names is not None and name not in tool_names:
        return None
    arguments = arguments_json(args)
    if arguments is None:
        return None
    return ToolCallDelta(index=index, id=new_call_id(), name=name, arguments=arguments)
