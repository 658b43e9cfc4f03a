"""The Response object a response job's record is, as the Responses API returns it: its status, its output items
(made from the job's chat result), its usage and error, and the request fields it echoes."""

from __future__ import annotations

from typing import Any

from chatq.core.job import Job, JobStatus

# The echoed request fields of a Response, with OpenAI's defaults for those left out.
ECHO_DEFAULTS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None},
    "store": True,
    "temperature": None,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": None,
    "user": None,
    "background": False,
}


def id_suffix(response_id: str) -> str:
    """What a response's item ids carry of its id."""
    return response_id.removeprefix("resp_")


def message_id(response_id: str) -> str:
    return f"msg_{id_suffix(response_id)}"


def reasoning_id(response_id: str) -> str:
    return f"rs_{id_suffix(response_id)}"


def call_item_id(call_id: str) -> str:
    return "fc_" + call_id.rsplit("-", 1)[-1]


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": call_item_id(call_id),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(response_id: str, result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The output items of a job's chat result: its reasoning, its text, its tool calls, in the order streamed."""
    if not result or not result.get("choices"):
        return []
    message = result["choices"][0].get("message") or {}
    out = []
    if message.get("reasoning"):
        out.append(reasoning_item(reasoning_id(response_id), message["reasoning"]))
    if message.get("content"):
        status = item_status(result["choices"][0].get("finish_reason"))
        out.append(message_item(message_id(response_id), message["content"], status))
    for call in message.get("tool_calls") or []:
        out.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return out


def item_status(finish_reason: str | None) -> str:
    """A message item's status once its choice ended: a text cut short (by max_output_tokens, a cancel or a failure)
    is `incomplete`."""
    return "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"


def _usage(job: Job) -> dict[str, Any]:
    chat = (job.result or {}).get("usage") or {}
    prompt = chat.get("prompt_tokens", len(job.prompt_ids))
    completion = chat.get("completion_tokens", job.completion_tokens)
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def status_of(job: Job) -> str:
    """The Response's status: a completed job whose text ran out of tokens is `incomplete`."""
    if job.status is JobStatus.completed and _finish_reason(job) == "length":
        return "incomplete"
    return job.status.value


def _finish_reason(job: Job) -> str | None:
    choices = (job.result or {}).get("choices") or [{}]
    return choices[0].get("finish_reason")


def response_error(error: dict[str, Any]) -> dict[str, Any]:
    """A chat error object as a Response's `error`, coded as OpenAI codes them: the request's own fault is an
    `invalid_prompt`, anything else a `server_error`."""
    code = "invalid_prompt" if error.get("type") == "BadRequestError" else "server_error"
    return {"code": code, "message": error.get("message", "")}


def response_object(job: Job) -> dict[str, Any]:
    """The Response a job is, as GET returns it."""
    stored = job.response or {}
    status = status_of(job)
    error = response_error(job.error) if job.error else None
    return {
        "id": job.id,
        "object": "response",
        "created_at": job.created,
        "completed_at": int(job.finished) if status == "completed" and job.finished else None,
        "status": status,
        "model": job.shown_model,
        "output": output_items(job.id, job.result),
        "usage": _usage(job) if job.status.finished else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        **(stored.get("request") or ECHO_DEFAULTS),
    }
