"""OpenAI's Responses API request, and the chat request a response's job runs: its input items as chat messages,
its fields as the chat fields, and the chat request's errors told in the Responses request's names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chatq.core.chat_request import ChatCompletionRequest, NamedToolChoice, chat_range
from chatq.core.errors import BadRequest
from chatq.core.response_object import ECHO_DEFAULTS, id_suffix

# What `include` may name that a chatq Response never holds (the outputs of built-in tools, images): nothing to add.
NOTHING_TO_INCLUDE = {
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
}
UNSUPPORTED_INCLUDES = {"message.output_text.logprobs", "reasoning.encrypted_content"}


class _Strict(BaseModel):
    # Anything OpenAI has that chatq does not do is refused by name, never silently ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; chatq writes no summaries


class ResponsesRequest(_Strict):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    model: str | None = None
    # The chat fields' ranges: the chat request the job runs checks them again.
    max_output_tokens: Annotated[int | None, chat_range("max_completion_tokens").interval()] = None
    temperature: Annotated[float | None, chat_range("temperature").interval()] = None
    top_p: Annotated[float | None, chat_range("top_p").interval()] = None
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise BadRequest(
                    f"Tools of type '{kind}' are not supported: chatq runs function tools.", f"tools[{i}].type"
                )
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, choice: Any) -> Any:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise BadRequest(
                f"tool_choice of type '{kind}' is not supported: chatq runs function tools.", "tool_choice"
            )
        return choice

    @field_validator("include")
    @classmethod
    def _includable(cls, include: list[str] | None) -> list[str] | None:
        for i, name in enumerate(include or []):
            if name in UNSUPPORTED_INCLUDES:
                raise BadRequest(f"include '{name}' is not supported by chatq.", f"include[{i}]")
            if name not in NOTHING_TO_INCLUDE:
                raise BadRequest(f"'{name}' is not a value include takes.", f"include[{i}]")
        return include

    def echo(self) -> dict[str, Any]:
        """The request's fields that a Response repeats."""
        given = self.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"input", "stream", "include"})
        if "reasoning" in given:
            given["reasoning"] = {**ECHO_DEFAULTS["reasoning"], **given["reasoning"]}
        return {k: given.get(k, default) for k, default in ECHO_DEFAULTS.items()}


def input_items(req: ResponsesRequest, response_id: str) -> list[dict[str, Any]]:
    """The request's input as items, each with an id (a string input is one user message)."""
    raw = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    return [_item(item, f"input[{i}]", f"{id_suffix(response_id)}_{i}") for i, item in enumerate(raw)]


def _item(item: dict[str, Any], where: str, suffix: str) -> dict[str, Any]:
    kind = item.get("type", "message")  # EasyInputMessage: a role and content, no type
    if kind == "message":
        return _message_item(item, where, suffix)
    if kind == "function_call":
        _need(item, ("call_id", "name", "arguments"), where)
        return {"type": kind, "id": item.get("id") or f"fc_{suffix}", "status": "completed", **_pick(item, kind)}
    if kind == "function_call_output":
        _need(item, ("call_id", "output"), where)
        if not isinstance(item["output"], str):
            raise BadRequest(f"{where}.output must be a string.", f"{where}.output")
        return {"type": kind, "id": item.get("id") or f"fco_{suffix}", "status": "completed", **_pick(item, kind)}
    if kind == "reasoning":  # an earlier answer's thought, sent back: kept, not rendered
        return {**item, "id": item.get("id") or f"rs_{suffix}"}
    raise BadRequest(f"Input items of type '{kind}' are not supported.", f"{where}.type")


def _pick(item: dict[str, Any], kind: str) -> dict[str, Any]:
    names = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
    return {n: item[n] for n in names}


def _need(item: dict[str, Any], names: tuple[str, ...], where: str) -> None:
    for n in names:
        if not isinstance(item.get(n), str):
            raise BadRequest(f"Missing required parameter: '{where}.{n}'.", f"{where}.{n}")


def _message_item(item: dict[str, Any], where: str, suffix: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise BadRequest(f"{where}.role must be user, system, developer or assistant.", f"{where}.role")
    content = item.get("content")
    part_type = "output_text" if role == "assistant" else "input_text"
    parts: list[dict[str, Any]]
    if isinstance(content, str):
        parts = [{"type": part_type, "text": content}]
    elif isinstance(content, list):
        parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
    else:
        raise BadRequest(f"{where}.content must be a string or a list of parts.", f"{where}.content")
    message: dict[str, Any] = {"type": "message", "id": item.get("id") or f"msg_{suffix}", "role": role}
    if role != "assistant":
        return {**message, "content": parts}
    # An assistant's message is an output message, which OpenAI's types give a status and its text annotations.
    parts = [{"annotations": [], **p} if p["type"] == "output_text" else p for p in parts]
    return {**message, "status": item.get("status") or "completed", "content": parts}


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
        raise BadRequest(f"Content parts of type '{kind}' are not supported; only input_text.", f"{where}.type")
    return part


def messages(items: list[dict[str, Any]], instructions: str | None) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """The conversation as chat messages: function calls join the assistant turn they follow. With them, for each
    message, the index of its item, then of each of its calls' items (-1: the instructions)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    origins: list[list[int]] = [[-1]] if instructions else []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            out.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
            origins.append([i])
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": _call_function(item)}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                origins[-1].append(i)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                origins.append([i, i])
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            origins.append([i])
    return out, origins


def _outputs_answer_calls(conversation: list[dict[str, Any]], first: int) -> None:
    """Each function call's output follows the call it answers, as OpenAI requires."""
    calls = set()
    for i, item in enumerate(conversation):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            why = f"No tool call found for function call output with call_id {item['call_id']}."
            raise BadRequest(why, f"input[{i - first}].call_id")


def _call_function(item: dict[str, Any]) -> dict[str, str]:
    return {"name": item["name"], "arguments": item["arguments"]}


def chat_request(
    req: ResponsesRequest, context: list[dict[str, Any]], items: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, Names]:
    """The chat request the job runs for `req`, over the whole conversation (the earlier responses' items in
    `context`, then this one's), and the names its errors are to be told in."""
    _outputs_answer_calls([*context, *items], len(context))
    msgs, origins = messages([*context, *items], req.instructions)
    if not msgs:
        raise BadRequest("input must hold at least one message.", "input")
    names = Names(origins, len(context))
    fields: dict[str, Any] = {
        "messages": msgs,
        "model": req.model,
        "stream": req.stream,
        "background": req.background,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "cache_salt": req.cache_salt,
        "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
        "response_format": _response_format(req.text),
    }
    if req.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"})} for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        fields["tool_choice"] = NamedToolChoice(function={"name": req.tool_choice.name})
    else:
        fields["tool_choice"] = req.tool_choice
    with names.renaming_errors():
        try:
            return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None}), names
        except ValidationError as e:  # what the Responses fields allow but a chat request does not
            first = e.errors()[0]
            raise BadRequest(first["msg"], ".".join(map(str, first["loc"]))) from None


# The chat request's fields that a Responses request names otherwise.
RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_RENAMED_WORD = re.compile(r"\b(" + "|".join(RENAMED) + r")\b")


@dataclass(frozen=True)
class Names:
    """Tells an error in the chat request a response runs in the Responses request's own names: `max_output_tokens`,
    `text.format`, and the input item a message came from (`input[2].arguments`)."""

    origins: list[list[int]]  # messages() second value
    context: int  # how many of the conversation's items an earlier response gave

    @contextmanager
    def renaming_errors(self) -> Iterator[None]:
        """A BadRequest raised inside is raised again with its message and param in the Responses names."""
        try:
            yield
        except BadRequest as e:
            raise BadRequest(_RENAMED_WORD.sub(lambda m: RENAMED[m[1]], e.message), self.param(e.param)) from None

    def param(self, chat: str | None) -> str | None:
        if chat is None:
            return None
        head, _, rest = chat.partition(".")
        if head == "messages":
            return self._item(rest)
        if head == "response_format":
            return "text.format" + rest.removeprefix("json_schema").rstrip(".")
        if head == "tools" and rest:
            index, _, field = rest.partition(".")
            return f"tools[{index}]" + field.removeprefix("function")
        return RENAMED.get(head, head) + (f".{rest}" if rest else "")

    def _item(self, path: str) -> str:
        index, _, rest = path.partition(".")
        if not index.isdigit() or int(index) >= len(self.origins):
            return "input"
        origin = self.origins[int(index)]
        call = rest.split(".")
        if call[0] == "tool_calls" and len(call) > 1 and call[1].isdigit() and int(call[1]) + 1 < len(origin):
            where, rest = self._where(origin[int(call[1]) + 1]), ".".join(call[2:]).removeprefix("function.")
        else:
            where = self._where(origin[0])
        return where + (f".{rest}" if rest and where.startswith("input") else "")

    def _where(self, item: int) -> str:
        if item < 0:
            return "instructions"
        return "previous_response_id" if item < self.context else f"input[{item - self.context}]"


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    for name, value in (("name", fmt.name), ("schema", fmt.schema_)):
        if not value:
            raise BadRequest(f"Missing required parameter: 'text.format.{name}'.", f"text.format.{name}")
    schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}
