"""Wire types shared by the API and the workers: the HTTP request body, the job record and the event envelope."""

from __future__ import annotations

import json
import time
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# --- the HTTP request ---------------------------------------------------------------------------------


class RequestError(ValueError):
    """A request field is invalid; `param` names it, as OpenAI's error object does."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
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
        """Content as one string: text parts are joined, other part types are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise RequestError(f"Content part type {part.get('type')!r} is not supported", "messages")
            texts.append(str(part.get("text", "")))
        return "".join(texts)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Fields of OpenAI's or vLLM's request that chatq does not honour yet: sending one (with a non-default value)
# is a 400 naming it, never a silent no-op.
UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "response_format",
    "structured_outputs",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "continue_final_message",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "return_tokens_as_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "top_k",
    "n",
    "continuous_usage_stats",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
)


class ChatCompletionRequest(BaseModel):
    # Unknown keys are accepted and ignored, as in vLLM; the known-but-unsupported ones are refused below.
    model_config = ConfigDict(extra="allow")

    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    background: bool = False

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    request_id: str | None = None
    priority: int = 0

    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    skip_special_tokens: bool = True

    @field_validator("stop", mode="after")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("stop may hold at most 4 sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def check(self) -> None:
        """Checks that need more than one field; raises RequestError with the offending param."""
        extra = self.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            value = extra.get(name, getattr(self, name, None))
            if name == "n" and value == 1:
                continue
            if name == "continuous_usage_stats":
                value = self.stream_options and self.stream_options.continuous_usage_stats
            if value not in (None, False, [], {}):
                raise RequestError(f"`{name}` is not supported by this server", name)
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise RequestError("temperature must be in [0, 2]", "temperature")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]", "top_p")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", "max_tokens")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise RequestError("max_completion_tokens must be at least 1", "max_completion_tokens")
        if self.stream_options is not None and not self.stream:
            raise RequestError("Stream options can only be defined when `stream=True`.", "stream_options")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise RequestError("seed must be a 64-bit integer", "seed")
        for m in self.messages:
            m.text()

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- the job record ----------------------------------------------------------------------------------


class JobStatus(StrEnum):
    queued = "queued"
    in_progress = "in_progress"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.completed, JobStatus.failed, JobStatus.cancelled)


class Job(BaseModel):
    """One chat completion job, stored as the Redis hash keys.job(id); every field is a string there."""

    id: str
    model: str
    created: int = Field(default_factory=lambda: int(time.time()))
    status: JobStatus = JobStatus.queued
    request: ChatCompletionRequest
    attempts: int = 0
    worker: str | None = None
    prompt_ids: list[int] = Field(default_factory=list)
    completion_tokens: int = 0
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    def to_redis(self) -> dict[str, str]:
        out = {
            "id": self.id,
            "model": self.model,
            "created": str(self.created),
            "status": self.status.value,
            "request": self.request.model_dump_json(exclude_unset=True),
            "attempts": str(self.attempts),
            "completion_tokens": str(self.completion_tokens),
        }
        if self.worker:
            out["worker"] = self.worker
        if self.prompt_ids:
            out["prompt_ids"] = json.dumps(self.prompt_ids)
        if self.result is not None:
            out["result"] = json.dumps(self.result)
        if self.error is not None:
            out["error"] = json.dumps(self.error)
        return out

    @classmethod
    def from_redis(cls, h: dict[str, str]) -> Job:
        return cls(
            id=h["id"],
            model=h["model"],
            created=int(h["created"]),
            status=JobStatus(h["status"]),
            request=ChatCompletionRequest.model_validate_json(h["request"]),
            attempts=int(h.get("attempts", 0)),
            worker=h.get("worker"),
            prompt_ids=json.loads(h.get("prompt_ids", "[]")),
            completion_tokens=int(h.get("completion_tokens", 0)),
            result=json.loads(h["result"]) if "result" in h else None,
            error=json.loads(h["error"]) if "error" in h else None,
        )


# --- the event envelope: one per pub/sub message and per event-log entry ------------------------------


class EventKind(StrEnum):
    chunk = "chunk"  # data: a chat.completion.chunk object
    error = "error"  # data: {"error": {...}} in OpenAI's error shape
    done = "done"  # data: null; the last event of every job


class Event(BaseModel):
    seq: int
    event: EventKind
    data: dict[str, Any] | None = None

    def sse_data(self) -> str:
        return "[DONE]" if self.event is EventKind.done else json.dumps(self.data, separators=(",", ":"))


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
