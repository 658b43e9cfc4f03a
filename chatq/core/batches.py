"""A batch's record in Redis (OpenAI's Batch object and its owner), the script that moves it between statuses, and
the check of its input file's lines."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ValidationError
from tokenizers import Tokenizer

from chatq.core import keys
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.files import BATCH_LINES
from chatq.core.lua import Script
from chatq.core.responses_request import ResponsesRequest

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
ENDPOINTS: tuple[str, ...] = get_args(Endpoint)
BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}
WINDOWS = {"24h": 86400}
# OpenAI's bounds on `metadata`: 16 pairs, keys of 64 characters, values of 512.
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
# OpenAI's statuses of a batch.
STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
# Statuses a batch may be cancelled from, and those it ends in.
CANCELLABLE = ("validating", "in_progress")
ENDED = ("failed", "completed", "expired", "cancelled")
# request_counts, and the token totals `usage` is made of: plain fields of the record, so scripts add to them.
COUNTS = ("total", "completed", "failed")
TOKENS = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")
# Line errors kept on a failed batch: enough to fix a file by, bounded so one bad file cannot fill a record.
MAX_ERRORS = 1000

Client = redis.Redis | aioredis.Redis


def new_id() -> str:
    return "batch_" + uuid.uuid4().hex


@dataclass(frozen=True)
class LineError:
    """One of OpenAI's BatchError entries: what is wrong with which line of the input file (1-based)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def view(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


_TIMES = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
_STAMPS = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


@dataclass
class Batch:
    """A batch as Redis keeps it: every field of OpenAI's Batch, and its owner."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    model: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKENS, 0))
    released: int = 0  # lines of the plan released into the queue so far
    output_expires_after: int | None = None  # seconds the output and error files last
    # The webhook messages its end sends (webhooks.WebhookMessages.block; "" for none), as the API that created it
    # was configured: whichever API ends it sends them.
    webhooks: str = ""
    times: dict[str, int | None] = field(default_factory=dict)

    def to_redis(self) -> dict[str, str]:
        plain = {
            "id": self.id,
            "owner": self.owner,
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "created_at": str(self.created_at),
            "expires_at": str(self.expires_at),
            "status": self.status,
            "model": self.model or "",
            "output_file_id": self.output_file_id or "",
            "error_file_id": self.error_file_id or "",
            "output_expires_after": "" if self.output_expires_after is None else str(self.output_expires_after),
            "webhooks": self.webhooks,
        }
        numbers = {k: str(v) for k, v in (self.counts | self.tokens | {"released": self.released}).items()}
        packed = {"metadata": self.metadata, "errors": self.errors}
        return plain | numbers | {k: json.dumps(v) for k, v in packed.items()}

    @classmethod
    def from_redis(cls, h: dict[str, str]) -> Batch:
        times = {name: int(h[name]) if h.get(name) else None for name in _TIMES if name != "expires_at"}
        return cls(
            id=h["id"],
            owner=h.get("owner", ""),
            endpoint=h["endpoint"],
            input_file_id=h["input_file_id"],
            completion_window=h["completion_window"],
            created_at=int(h["created_at"]),
            expires_at=int(h["expires_at"]),
            status=h["status"],
            metadata=json.loads(h.get("metadata") or "null"),
            model=h.get("model") or None,
            output_file_id=h.get("output_file_id") or None,
            error_file_id=h.get("error_file_id") or None,
            errors=json.loads(h.get("errors") or "null"),
            counts={k: int(h.get(k) or 0) for k in COUNTS},
            tokens={k: int(h.get(k) or 0) for k in TOKENS},
            released=int(h.get("released") or 0),
            output_expires_after=int(h["output_expires_after"]) if h.get("output_expires_after") else None,
            webhooks=h.get("webhooks", ""),
            times=times,
        )

    def usage(self) -> dict[str, Any] | None:
        """OpenAI's BatchUsage: the tokens of the lines answered so far; none before the batch runs."""
        if self.status in ("validating", "failed"):
            return None
        t = self.tokens
        return {
            "input_tokens": t["input_tokens"],
            "input_tokens_details": {"cached_tokens": t["cached_tokens"]},
            "output_tokens": t["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": t["reasoning_tokens"]},
            "total_tokens": t["input_tokens"] + t["output_tokens"],
        }

    def view(self) -> dict[str, Any]:
        """OpenAI's Batch object."""
        errors = None if self.errors is None else {"object": "list", "data": self.errors}
        stamps = {name: self.times.get(name) for name in _TIMES}
        return (
            {
                "id": self.id,
                "object": "batch",
                "endpoint": self.endpoint,
                "model": self.model,
                "errors": errors,
                "input_file_id": self.input_file_id,
                "completion_window": self.completion_window,
                "status": self.status,
                "output_file_id": self.output_file_id,
                "error_file_id": self.error_file_id,
                "created_at": self.created_at,
                "request_counts": self.counts,
                "metadata": self.metadata,
                "usage": self.usage(),
            }
            | stamps
            | {"expires_at": self.expires_at}
        )


# Moves a batch to `to` and stamps `stamp` with Redis's time, only from one of `start` (comma-separated). With it:
# `fields` are set, the count of batches in each status follows, a batch that has lines to run from now on joins the
# batches the APIs run (`run` "1"), and an end's webhook messages (webhooks.WebhookMessages.block, "" for none) are
# pushed, so no end is lost before its webhook. A batch going in progress with `tokens` holds them in its owner's
# batch tokens of its model unless that passes `limit` (-1, and it does not move); an end gives back what it held.
# 1 if it moved: two processes never both make the same move.
_MOVE = Script(
    keys=(
        "record",
        "statuses",
        "running",
        "held",  # the owner's batch tokens held, by model (keys.batch_tokens)
    ),
    args=("batch_id", "start", "to", "stamp", "run", "webhooks", "ended", "model", "tokens", "limit"),
    tail="fields",
    body="""
local status = redis.call('HGET', record, 'status')
if not status or not string.find(',' .. start .. ',', ',' .. status .. ',', 1, true) then
  return 0
end
if tonumber(tokens) > 0 then
  if tonumber(redis.call('HGET', held, model) or '0') + tonumber(tokens) > tonumber(limit) then return -1 end
  redis.call('HINCRBY', held, model, tokens)
  redis.call('HSET', record, 'held_tokens', tokens)
end
if ended == '1' then
  local h = redis.call('HMGET', record, 'held_tokens', 'model')
  if h[1] then
    if redis.call('HINCRBY', held, h[2] or '', -tonumber(h[1])) <= 0 then redis.call('HDEL', held, h[2] or '') end
    redis.call('HDEL', record, 'held_tokens')
  end
end
local t = redis.call('TIME')
redis.call('HSET', record, 'status', to, stamp, t[1])
redis.call('HINCRBY', statuses, status, -1)
redis.call('HINCRBY', statuses, to, 1)
if #fields > 0 then
  redis.call('HSET', record, unpack(fields))
end
if run == '1' then
  redis.call('ZADD', running, 'NX', t[1], batch_id)
end
if webhooks ~= '' and string.match(to, '^[%w_]+$') then
  local w = cjson.decode(webhooks)
  for _, m in ipairs(w.messages) do redis.call('LPUSH', w.queue, m[1] .. 'batch.' .. to .. m[2]) end
end
return 1
""",
)
# The statuses of a batch with lines to run or end, which an API's batch runner takes up.
RUNNING = ("in_progress", "cancelling", "finalizing")


def create(client: Client, batch: Batch, listed_at: float) -> Any:
    """Writes a new batch's record and lists it for its owner at `listed_at`, in one transaction."""
    pipe = client.pipeline(transaction=True)
    fields: dict[Any, Any] = batch.to_redis()
    pipe.hset(keys.batch(batch.id), mapping=fields)
    pipe.zadd(keys.owner_batches(batch.owner), {batch.id: listed_at})
    pipe.hincrby(keys.batch_statuses(), batch.status, 1)
    return pipe.execute()


PROMPT_FIELDS = ("instructions", "messages", "prompt", "input")  # what a line's request brings the model to read


def input_tokens(tokenizer: Tokenizer, lines: list[tuple[int, str]], chunk: int = 1024) -> int:
    """The lines' input tokens as OpenAI's batch queue counts them, an estimate made before any line is rendered:
    the tokenizer's count of each request's prompt fields, as JSON text."""
    total = 0
    for i in range(0, len(lines), chunk):
        bodies = [json.loads(text)["body"] for _, text in lines[i : i + chunk]]
        texts = [json.dumps([b[f] for f in PROMPT_FIELDS if f in b], ensure_ascii=False) for b in bodies]
        total += sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    return total


@dataclass(frozen=True, slots=True)
class Hold:
    """Input tokens a batch going in progress holds in its owner's batch tokens of its model, at most `limit`."""

    model: str
    tokens: int
    limit: int


def move(
    client: Client,
    batch: Batch,
    start: tuple[str, ...],
    to: str,
    webhook: str = "",
    hold: Hold | None = None,
    fields: dict[str, Any] | None = None,
) -> Any:
    """Moves the batch to status `to` if it is in one of `start`, setting `fields` (JSON-encoded unless strings) and
    pushing `webhook` (chatq.core.webhooks.WebhookMessages.block) if `to` is an end; 1 (awaited, for an asyncio
    client) if it moved, 0 if not, -1 if its `hold` would pass its owner's limit. A batch moved in progress or
    cancelling joins the batches the APIs run; an end gives back the tokens it held."""
    flat = [x for k, v in (fields or {}).items() for x in (k, v if isinstance(v, str) else json.dumps(v))]
    block = webhook if to in ENDED else ""
    return _MOVE.run(
        client,
        record=keys.batch(batch.id),
        statuses=keys.batch_statuses(),
        running=keys.batches_running(),
        held=keys.batch_tokens(batch.owner),
        batch_id=batch.id,
        start=",".join(start),
        to=to,
        stamp=_STAMPS[to],
        run="1" if to in ("in_progress", "cancelling") else "",
        webhooks=block,
        ended="1" if to in ENDED else "0",
        model=hold.model if hold else "",
        tokens=hold.tokens if hold else 0,
        limit=hold.limit if hold else 0,
        fields=flat,
    )


@dataclass
class LineCheck:
    """The check of an input file's lines against a batch's endpoint: each line's own errors, the custom_ids seen,
    and the models the lines name (each must be served: the caller checks them once the file is read)."""

    endpoint: str
    seen: set[str] = field(default_factory=set)
    models: dict[str, int] = field(default_factory=dict)
    lines: int = 0
    kept: list[tuple[int, str]] = field(default_factory=list)  # the lines that passed, as (number, text)

    def check(self, number: int, text: str) -> LineError | None:
        """The first thing wrong with line `number` (1-based), or None."""
        self.lines = number
        if number > BATCH_LINES:
            return LineError("too_many_requests", f"A batch holds at most {BATCH_LINES} requests.", number)
        try:
            line = json.loads(text)
        except ValueError:
            return LineError("invalid_json_line", "This line is not valid JSON.", number)
        if not isinstance(line, dict):
            return LineError("invalid_json_line", "This line is not a JSON object.", number)
        return self._request(number, line)

    def _request(self, number: int, line: dict[str, Any]) -> LineError | None:
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return LineError("missing_required_parameter", "A line needs a string custom_id.", number, "custom_id")
        if custom_id in self.seen:
            return LineError("duplicate_custom_id", f"The custom_id '{custom_id}' is used twice.", number, "custom_id")
        self.seen.add(custom_id)
        if line.get("method") != "POST":
            return LineError("invalid_method", "The method of a batch request must be POST.", number, "method")
        if line.get("url") != self.endpoint:
            message = f"The url must be the batch's endpoint, {self.endpoint}."
            return LineError("invalid_url", message, number, "url")
        body = line.get("body")
        if not isinstance(body, dict):
            return LineError("invalid_request", "The body must be a JSON object.", number, "body")
        for flag in ("stream", "background"):
            if body.get(flag):
                message = f"A batch request may not set {flag}."
                return LineError("invalid_request", message, number, f"body.{flag}")
        return self._body(number, body)

    def _body(self, number: int, body: dict[str, Any]) -> LineError | None:
        try:
            request = BODIES[self.endpoint].model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()))
            message = first.get("msg", "Invalid request").removeprefix("Value error, ")
            return LineError("invalid_request", message, number, f"body.{param}" if param else "body")
        model = getattr(request, "model", None) or ""
        self.models.setdefault(model, number)
        return None

    def keep(self, number: int, text: str) -> None:
        self.kept.append((number, text))
