"""The job record in Redis and the event envelope of its log and live channel."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from chatq.core.adapters import Adapter
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest


class JobStatus(StrEnum):
    queued = "queued"
    in_progress = "in_progress"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.completed, JobStatus.failed, JobStatus.cancelled)


def cache_partition(owner: str, cache_salt: str | None, shared: bool) -> str:
    """A job's partition of the prefix cache: its API key's (`owner`, the key's hash) unless the cache is `shared`
    across keys, and within it its cache_salt's; "" where neither applies."""
    scope = ("" if shared else owner, cache_salt or "")
    if not any(scope):
        return ""
    return hashlib.sha256("\0".join(scope).encode()).hexdigest()


class Job(BaseModel):
    """One chat completion job, stored as the Redis hash keys.job(id); every field is a string there."""

    id: str
    model: str
    kind: Literal["chat", "text", "response"] = "chat"  # a response runs as a chat request
    created: int = Field(default_factory=lambda: int(time.time()))
    status: JobStatus = JobStatus.queued
    request: ChatCompletionRequest | CompletionRequest
    attempts: int = 0
    worker: str | None = None
    prompt_ids: list[int] = Field(default_factory=list)  # the prompt as it runs; of a batch, the first
    # A legacy request's batch of prompts, each as it runs, in order (empty for one prompt): each has its `n` choices.
    batch: list[list[int]] = Field(default_factory=list)
    completion_tokens: int = 0
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    # The W3C trace context of the request that submitted the job ("" for none): the worker's spans continue it.
    traceparent: str = ""
    tracestate: str = ""
    # A response's own fields (chatq.core.response_object): its echoed request, its input items and the earlier items
    # its conversation starts with.
    response: dict[str, Any] | None = None
    # The job's partition of the workers' prefix cache, a hex digest ("" for the one every job of an open API without
    # a cache_salt shares): set where the job is submitted, from its API key and cache_salt.
    cache_partition: str = ""
    # The LoRA adapter it runs with, as it was known when the job was submitted; None: the model alone.
    adapter: Adapter | None = None
    # When the job ended (unix seconds), as its worker wrote it; read only.
    finished: float | None = None

    @property
    def shown_model(self) -> str:
        """The model its answer names: the adapter the request named, or the model."""
        return self.adapter.name if self.adapter is not None else self.model

    @property
    def prompts(self) -> list[list[int]]:
        """Every prompt, in order: choice i answers prompt i // n."""
        return self.batch or [self.prompt_ids]

    @property
    def prompt_tokens(self) -> int:
        """The usage's prompt_tokens: each prompt counted once, whatever its number of choices."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.request.n

    def to_redis(self) -> dict[str, str]:
        out = {
            "id": self.id,
            "model": self.model,
            "kind": self.kind,
            "created": str(self.created),
            "status": self.status.value,
            "request": self.request.model_dump_json(exclude_unset=True, by_alias=True),
            "attempts": str(self.attempts),
            "completion_tokens": str(self.completion_tokens),
        }
        if self.worker:
            out["worker"] = self.worker
        if self.prompt_ids:
            out["prompt_ids"] = json.dumps(self.prompt_ids)
        if self.batch:
            out["batch"] = json.dumps(self.batch)
        if self.result is not None:
            out["result"] = json.dumps(self.result)
        if self.error is not None:
            out["error"] = json.dumps(self.error)
        if self.traceparent:
            out["traceparent"] = self.traceparent
        if self.tracestate:
            out["tracestate"] = self.tracestate
        if self.response is not None:
            out["response"] = json.dumps(self.response)
        if self.cache_partition:
            out["cache_partition"] = self.cache_partition
        if self.adapter is not None:
            out["adapter"] = self.adapter.model_dump_json()
        return out

    @classmethod
    def from_redis(cls, h: dict[str, str]) -> Job:
        kind: Literal["chat", "text", "response"] = "chat"
        if h.get("kind") in ("text", "response"):
            kind = "text" if h["kind"] == "text" else "response"
        request_type = CompletionRequest if kind == "text" else ChatCompletionRequest
        return cls(
            id=h["id"],
            model=h["model"],
            kind=kind,
            created=int(h["created"]),
            status=JobStatus(h["status"]),
            request=request_type.model_validate_json(h["request"]),
            attempts=int(h.get("attempts", 0)),
            worker=h.get("worker"),
            prompt_ids=json.loads(h.get("prompt_ids", "[]")),
            batch=json.loads(h.get("batch", "[]")),
            completion_tokens=int(h.get("completion_tokens", 0)),
            result=json.loads(h["result"]) if "result" in h else None,
            error=json.loads(h["error"]) if "error" in h else None,
            traceparent=h.get("traceparent", ""),
            tracestate=h.get("tracestate", ""),
            response=json.loads(h["response"]) if "response" in h else None,
            cache_partition=h.get("cache_partition", ""),
            adapter=Adapter.model_validate_json(h["adapter"]) if "adapter" in h else None,
            finished=float(h["finished"]) if "finished" in h else None,
        )


# --- the event envelope: one per pub/sub message and per event-log entry ------------------------------


class EventKind(StrEnum):
    chunk = "chunk"  # data: a chat.completion.chunk object
    error = "error"  # data: {"error": {...}} in OpenAI's error shape
    done = "done"  # the last event of every job; data: the final object for a completed non-streamed request, else null


# A dict lookup: EnumType.__call__ is slow, and the API reads every relayed event.
_EVENT_KINDS = {k.value: k for k in EventKind}


@dataclass(slots=True)
class Event:
    """A plain dataclass, encoded with orjson: the worker builds and the API relays one per streamed token, and
    pydantic's validation of the nested chunk object costs more than the rest of a relayed frame."""

    seq: int
    event: EventKind
    data: dict[str, Any] | None = None
    # The ids of the tokens generated for the chunk's choice since its last chunk: what a worker taking the job over
    # replays to continue where the log stops.
    ids: list[int] | None = None
    _json: bytes | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> bytes:
        """The `msg` of the log entry and of the pub/sub message, encoded once."""
        if self._json is None:
            envelope = {"seq": self.seq, "event": self.event, "data": self.data}
            if self.ids:
                envelope["ids"] = self.ids
            self._json = orjson.dumps(envelope)
        return self._json

    @classmethod
    def from_json(cls, msg: str | bytes) -> Event:
        d = orjson.loads(msg)
        return cls(d["seq"], _EVENT_KINDS[d["event"]], d.get("data"), d.get("ids"))

    def sse_data(self) -> bytes:
        return b"[DONE]" if self.event is EventKind.done else orjson.dumps(self.data)

    def sse_frame(self) -> bytes:
        """The event as one Server-Sent Events frame, its id the sequence number (for Last-Event-ID)."""
        return b"id: %d\ndata: %s\n\n" % (self.seq, self.sse_data())
