"""Deltas -> OpenAI objects: `chat.completion.chunk` for each streamed event and the final `chat.completion`."""

from __future__ import annotations

from typing import Any

from worker.parse import Delta

SYSTEM_FINGERPRINT = "chatq"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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


class ChunkMaker:
    """Builds the chunks of one job; id, created and model are the same in every chunk."""

    def __init__(self, completion_id: str, created: int, model: str):
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def choice(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**self.base, "choices": [choice]}

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def completion(
    completion_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
