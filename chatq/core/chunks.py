"""Deltas -> OpenAI objects: the streamed chunks and the final object, for chat and for legacy text completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.delta import Delta
from chatq.core.job import Job

SYSTEM_FINGERPRINT = "chatq"


@dataclass
class TokenInfo:
    """One generated token's logprob entry, already decoded. A token's bytes are its text's UTF-8, except for a token
    that holds part of a character, whose text is U+FFFD: then they are what it holds, for a client to join."""

    token: str
    logprob: float | None  # None: an echoed prompt's first token, which nothing comes before
    top: list[tuple[str, float, list[int] | None]]  # (token, logprob, bytes)
    offset: int = 0  # where its text begins in the choice's text (legacy text_offset)
    bytes: list[int] | None = None  # None: the token's UTF-8


def usage(
    prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage object, every key present as in vLLM's whole answer: reasoning_tokens (given when a reasoning
    parser ran) and cached_tokens (the prompt tokens the prefix cache served, once known) go into its details, which
    are null without them."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
        "completion_tokens_details": None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens},
    }


def delta_json(delta: Delta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for c in delta.tool_calls:
            call: dict[str, Any] = {"index": c.index}
            if c.id is not None:
                call.update(id=c.id, type="function", function={"name": c.name, "arguments": c.arguments})
            else:
                call["function"] = {"arguments": c.arguments}
            calls.append(call)
        out["tool_calls"] = calls
    return out


def _entry(token: str, logprob: float | None, raw: list[int] | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()) if raw is None else raw}


def chat_logprobs(tokens: list[TokenInfo]) -> dict[str, Any]:
    return {
        "content": [
            {**_entry(t.token, t.logprob, t.bytes), "top_logprobs": [_entry(*top) for top in t.top]} for t in tokens
        ]
    }


def text_logprobs(tokens: list[TokenInfo]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, with each token's character offset in the text."""
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        # The sampled token first, then the top ones (OpenAI's and vLLM's legacy shape).
        "top_logprobs": [
            None if t.logprob is None else {t.token: t.logprob, **{s: lp for s, lp, _ in t.top}} for t in tokens
        ],
        "text_offset": [t.offset for t in tokens],
    }


class ChatFormatter:
    """One chat job's OpenAI objects: its stream chunks (`chat.completion.chunk`), and its final choices and object
    (`chat.completion`)."""

    object = "chat.completion"

    def __init__(self, completion_id: str, created: int, model: str, role: str):
        self.role = role
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        self.final_base = {**self.base, "object": self.object}

    def start(self, index: int) -> dict[str, Any] | None:
        return self.chunk(index, {"role": self.role, "content": ""})

    def chunk(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**self.base, "choices": [choice]}

    def logprobs(self, tokens: list[TokenInfo]) -> dict[str, Any]:
        return chat_logprobs(tokens)

    @staticmethod
    def read_logprobs(logprobs: dict[str, Any] | None) -> list[TokenInfo]:
        """The entries a chunk's logprobs hold, as `logprobs` took them."""
        return [
            TokenInfo(
                e["token"],
                e["logprob"],
                [(t["token"], t["logprob"], t["bytes"]) for t in e["top_logprobs"]],
                0,
                e["bytes"],
            )
            for e in (logprobs or {}).get("content") or []
        ]

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The stream's last chunk, its usage without the null details, as vLLM leaves them out."""
        return {**self.base, "choices": [], "usage": {k: v for k, v in usage.items() if v is not None}}

    def running_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The usage a chunk carries under `continuous_usage_stats`: vLLM's chat chunks name the completion details
        (null without a reasoning parser), never the prompt's."""
        return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}

    def final_choice(
        self,
        index: int,
        content: str | None,
        reasoning: str | None,
        tool_calls: list[dict[str, Any]],
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
        stop_reason,
    ) -> dict[str, Any]:
        # The keys vLLM and OpenAI always send, null where chatq has nothing for them.
        message: dict[str, Any] = {
            "role": self.role,
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": reasoning,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def final(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.final_base, "choices": choices, "usage": usage}


def formatter_for(job: Job) -> ChatFormatter:
    """The formatter of the job's kind: chat, or legacy text completions."""
    if isinstance(job.request, ChatCompletionRequest):
        return ChatFormatter(job.id, job.created, job.shown_model, job.request.response_role)
    return TextFormatter(job.id, job.created, job.shown_model)


def cancelled_while_queued(job: Job, opened: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The stream chunks and the final object of a job cancelled while it was queued: each choice opens and
    ends with `abort` and no text, as vLLM answers a request aborted while waiting, so a client learns why there is
    no answer (a non-streamed one reading `choices[0]` finds it). `opened`: an earlier attempt's stream opened the
    choices already (the job waits for another worker to continue it)."""
    formatter = formatter_for(job)
    stream = []
    for i in range(job.num_choices):
        first = None if opened else formatter.start(i)
        stream += [first] if first is not None else []
        stream.append(formatter.chunk(i, {}, None, "abort", None))
    choices = [formatter.final_choice(i, "", None, [], None, "abort", None) for i in range(job.num_choices)]
    return stream, formatter.final(choices, usage(job.prompt_tokens, 0))


class TextFormatter(ChatFormatter):
    """Legacy /v1/completions: the same events, shaped as `text_completion` objects."""

    object = "text_completion"

    def __init__(self, completion_id: str, created: int, model: str):
        super().__init__(completion_id, created, model, role="")
        self.base = {**self.base, "object": self.object}
        self.final_base = dict(self.base)

    def start(self, index: int) -> dict[str, Any] | None:
        return None

    def chunk(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": delta.get("content", ""),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        return {**self.base, "choices": [choice]}

    def logprobs(self, tokens: list[TokenInfo]) -> dict[str, Any]:
        return text_logprobs(tokens)

    def running_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """vLLM's legacy chunks count the tokens only."""
        return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}

    @staticmethod
    def read_logprobs(logprobs: dict[str, Any] | None) -> list[TokenInfo]:
        """The entries a chunk's logprobs hold, as `logprobs` took them (the top ones hold the sampled token)."""
        if not logprobs:
            return []
        columns = zip(*(logprobs[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")), strict=True)
        return [TokenInfo(t, lp, [(s, v, None) for s, v in (top or {}).items()], o) for t, lp, top, o in columns]

    def final_choice(
        self,
        index: int,
        content: str | None,
        reasoning: str | None,
        tool_calls: list[dict[str, Any]],
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
        stop_reason,
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": content,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
