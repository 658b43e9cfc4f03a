"""The chat completions request body: messages, tools and the chat fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chatq.core.errors import BadRequest
from chatq.core.requests import (
    MAX_MESSAGES,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    Range,
    bounded,
    token_limit,
)
from chatq.core.schemas import check_schema

# Content part type -> the key holding its text.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    # Any role: one besides the five reaches the chat template as given, as vLLM passes it.
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _rename_reasoning_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reasoning_content" in data and "reasoning" not in data:
            data = dict(data)
            data["reasoning"] = data.pop("reasoning_content")
        return data

    def text(self) -> str | None:
        """Content as one string: text parts are joined, a line apart; other part types are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(self.texts())  # as vLLM joins them for a template that takes content as one string

    def texts(self) -> list[str]:
        """Content as its text parts; other part types are refused."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [self.content]
        texts = []
        for part in self.content:
            kind = part.get("type")
            # The part types vLLM reads as text: the Responses API's input and output text, an earlier assistant
            # turn's refusal and thinking.
            key = _TEXT_PARTS.get(kind)  # type: ignore[arg-type]
            if key is None:
                raise BadRequest(f"Content part type {kind!r} is not supported", "messages")
            if not isinstance(part.get(key), str):
                raise BadRequest(f"A {kind} content part needs its `{key}` as a string.", "messages")
            texts.append(part[key])
        return texts


class Function(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _no_parameters(cls, v: Any) -> Any:
        # null, as vLLM reads it: a function that takes no parameters.
        return {"type": "object", "properties": {}} if v is None else v


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: Function


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = bounded(None, token_limit("max_completion_tokens"))
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    # Whether the tokenizer adds its own special tokens (a BOS) around the rendered prompt: off, as in vLLM, since
    # chat templates write them.
    add_special_tokens: bool = False
    # vLLM's set; the value itself only reaches the chat template.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    documents: list[dict[str, Any]] | None = None  # for the chat template, as vLLM passes them
    # The request's own chat template, taken only where CHATQ_TRUST_REQUEST_CHAT_TEMPLATE allows it.
    chat_template: str | None = None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def thinking(self) -> bool:
        """Whether the model is asked to think: `chat_template_kwargs.enable_thinking` if given, else off only for
        `reasoning_effort: "none"` (vLLM hands the template that choice as `enable_thinking`)."""
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs:
            return kwargs["enable_thinking"] is not False
        return self.reasoning_effort != "none"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """How many alternatives per prompt token to report, or None for no prompt logprobs: vLLM makes them for an
        echo too, `top_logprobs` of them."""
        if self.prompt_logprobs is None and self.echo:
            return self.top_logprobs or 0
        return self.prompt_logprobs

    @property
    def logprobs_needed(self) -> str:
        return "`logprobs` must be set to true"

    def check(self) -> None:
        super().check()
        if len(self.messages) > MAX_MESSAGES:
            raise BadRequest(f"`messages` may hold at most {MAX_MESSAGES} messages.", "messages")
        if len(self.tools or []) > MAX_TOOLS:
            raise BadRequest(f"`tools` may hold at most {MAX_TOOLS} tools.", "tools")
        if self.top_logprobs is not None:
            # vLLM's rule: 0 (its default) asks for nothing, so it needs no logprobs.
            if self.top_logprobs != 0 and not self.logprobs:
                raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise BadRequest(
                    f"`top_logprobs` must be a value in the interval [0, {MAX_TOP_LOGPROBS}].", "top_logprobs"
                )
        self._check_tools()
        if self.use_beam_search and (self.forced_tool or self.tool_choice == "required"):
            raise BadRequest("A named or `required` `tool_choice` is not supported with beam search.", "tool_choice")
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise BadRequest(
                "`continue_final_message` needs the last message to be an assistant message.", "continue_final_message"
            )
        for m in self.messages:
            m.text()

    def _check_tools(self) -> None:
        if self.tools is not None and not self.tools:
            raise BadRequest("`tools` must not be an empty list; leave it out instead.", "tools")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.get("name")
            if name not in {t.function.name for t in self.tools or []}:
                raise BadRequest(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
        if self.structured_outputs is not None and isinstance(self.tool_choice, NamedToolChoice):
            raise BadRequest(
                "`structured_outputs` cannot be combined with a named `tool_choice`.", "structured_outputs"
            )
        forced = self.tool_choice.function.get("name") if isinstance(self.tool_choice, NamedToolChoice) else None
        for i, tool in enumerate(self.tools or []):
            # Only `required` and a named tool constrain parameters with a grammar; under `auto`, an unenforceable
            # schema is the model's and the client's business, as in vLLM.
            constrains = self.tool_choice == "required" or tool.function.name == forced
            check_schema(tool.function.parameters, f"tools.{i}.function.parameters", constrains)

    @property
    def forced_tool(self) -> str | None:
        """The function a named tool_choice forces, if any."""
        return self.tool_choice.function.get("name") if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def response_role(self) -> str:
        # vLLM answers in the last message's role when no generation prompt opens an assistant turn.
        return "assistant" if self.add_generation_prompt else self.messages[-1].role


def chat_range(name: str) -> Range:
    """The range of a chat request's field."""
    allowed = ChatCompletionRequest.model_fields[name].json_schema_extra
    assert isinstance(allowed, Range), name
    return allowed
