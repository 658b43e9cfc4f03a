"""A running batch's lines in Redis: its plan (the input's lines in the order they are released), each line released
into the queue, each answered once, and the output and error files' lines they become.

A line is released (its number in the batch's released set, and in its model's batch lines) before its job is
submitted, and answered (its file line written once into the batch's results, the job's record and log deleted) in
one script: whatever stops between the two, the next runner finds a released line and either its job or none, which
it submits again. The results hash holds each line at most once, so the files made from it hold each exactly once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from chatq.core import keys
from chatq.core.lua import Script

# Lines of the plan sort by the first characters of their prompt, so lines sharing a system prompt or a document run
# one after another and the prefix cache serves them; beyond this many, the order is the input's.
PREFIX_CHARS = 4096


@dataclass(frozen=True)
class PlanLine:
    """One line of the input, as the plan keeps it: its number (1-based) in the input, custom_id and body."""

    number: int
    custom_id: str
    body: dict[str, Any]

    def job_request_id(self, batch_id: str) -> str:
        """The id its job is submitted under: the same for every release of it, so a line's job is found again."""
        return f"{batch_id}-{self.number}"


def prefix_key(body: dict[str, Any]) -> str:
    """What a line's place in the plan follows: the start of its prompt, as the request gives it."""
    prompt = body.get("messages") or body.get("prompt") or [body.get("instructions"), body.get("input")]
    return json.dumps(prompt, ensure_ascii=False, sort_keys=True)[:PREFIX_CHARS]


def plan_lines(lines: Iterable[tuple[int, str]]) -> Iterator[bytes]:
    """The plan file's lines from the input's (number, text) lines: each `number text`, in prefix order."""
    keyed = []
    for number, text in lines:
        line = json.loads(text)
        keyed.append((prefix_key(line["body"]), number, text))
    keyed.sort(key=lambda k: (k[0], k[1]))
    for _, number, text in keyed:
        yield f"{number} {text.strip()}\n".encode()


def read_plan_line(raw: bytes) -> PlanLine:
    number, text = raw.decode().split(" ", 1)
    line = json.loads(text)
    return PlanLine(int(number), line["custom_id"], line["body"])


def plan_name(batch_id: str) -> str:
    """The plan's name in the file store: no file id, so no owner lists or reads it."""
    return f"{batch_id}.plan"


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of the batch's output (`kind` "output") or error file: one per batch, however often it is written."""
    return f"file-{batch_id.removeprefix('batch_')}{kind}"


def line_id(batch_id: str, number: int) -> str:
    """The `id` of a line in the output or error file."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{number}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Answer:
    """What a line came to: its line of the output or error file, and the tokens it adds to the batch's usage."""

    kind: str  # "output" or "error"
    line: dict[str, Any]
    tokens: dict[str, int]

    @property
    def outcome(self) -> str:
        """The request_counts field it adds to."""
        return "completed" if self.kind == "output" else "failed"


def answered(batch_id: str, line: PlanLine, job_id: str, status_code: int, body: dict[str, Any]) -> Answer:
    """A line whose request was answered: status 200 goes to the output file, any other to the error file."""
    response = {"status_code": status_code, "request_id": job_id, "body": body}
    entry = {"id": line_id(batch_id, line.number), "custom_id": line.custom_id, "response": response, "error": None}
    return Answer("output" if status_code == 200 else "error", entry, _tokens(body) if status_code == 200 else {})


def unanswered(batch_id: str, line: PlanLine | tuple[int, str], code: str, message: str) -> Answer:
    """A line the batch ended before answering (`batch_expired`, `batch_cancelled`): the error file's, no response."""
    number, custom_id = (line.number, line.custom_id) if isinstance(line, PlanLine) else line
    error = {"code": code, "message": message}
    return Answer(
        "error", {"id": line_id(batch_id, number), "custom_id": custom_id, "response": None, "error": error}, {}
    )


def _tokens(body: dict[str, Any]) -> dict[str, int]:
    """The usage of a chat completion, legacy completion or response, in BatchUsage's terms."""
    usage = body.get("usage") or {}
    prompt = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    output = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    out_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    return {
        "input_tokens": int(prompt),
        "cached_tokens": int(details.get("cached_tokens") or 0),
        "output_tokens": int(output),
        "reasoning_tokens": int(out_details.get("reasoning_tokens") or 0),
    }


def member(batch_id: str, number: int) -> str:
    """A line's member in its model's batch lines."""
    return f"{batch_id}:{number}"


# A line released: in its batch's released set and its model's batch lines; the batch's `released` count (how far
# into the plan its runners got) only grows.
_RELEASE = Script(
    keys=("record", "released", "model_lines"),
    args=("line", "member", "now", "cursor"),
    body="""
redis.call('ZADD', released, now, line)
redis.call('ZADD', model_lines, now, member)
if tonumber(cursor) > tonumber(redis.call('HGET', record, 'released') or '0') then
  redis.call('HSET', record, 'released', cursor)
end
""",
)

# A line answered, once: its file line kept, it leaves the released lines, its batch counts it and adds its tokens,
# and what its job left (`dropped`: its record and log, if it ran) is deleted. 0 if it was answered before.
_ANSWER = Script(
    keys=("record", "results", "released", "model_lines", "line_counts"),
    key_tail="dropped",
    args=("line", "member", "entry", "outcome"),
    tail="tokens",  # name, amount pairs
    body="""
if redis.call('HSETNX', results, line, entry) == 0 then return 0 end
redis.call('ZREM', released, line)
redis.call('ZREM', model_lines, member)
redis.call('HINCRBY', record, outcome, 1)
redis.call('HINCRBY', line_counts, outcome, 1)
for i = 1, #tokens, 2 do redis.call('HINCRBY', record, tokens[i], tokens[i + 1]) end
if #dropped > 0 then redis.call('DEL', unpack(dropped)) end
return 1
""",
)


def release(client: aioredis.Redis, batch_id: str, model: str, number: int, cursor: int, now: float) -> Any:
    return _RELEASE.run(
        client,
        record=keys.batch(batch_id),
        released=keys.batch_released(batch_id),
        model_lines=keys.batch_lines(model),
        line=number,
        member=member(batch_id, number),
        now=now,
        cursor=cursor,
    )


def answer(client: aioredis.Redis, batch_id: str, model: str, number: int, result: Answer, job_id: str | None) -> Any:
    """Keeps the line's answer unless it has one; true (awaited) if this one was kept."""
    entry = json.dumps({"kind": result.kind, "line": result.line}, ensure_ascii=False)
    dropped = [keys.job(job_id), keys.events(job_id)] if job_id is not None else []
    return _ANSWER.run(
        client,
        record=keys.batch(batch_id),
        results=keys.batch_results(batch_id),
        released=keys.batch_released(batch_id),
        model_lines=keys.batch_lines(model),
        line_counts=keys.batch_line_counts(),
        dropped=dropped,
        line=number,
        member=member(batch_id, number),
        entry=entry,
        outcome=result.outcome,
        tokens=[x for kv in result.tokens.items() for x in kv],
    )


async def results(client: aioredis.Redis, batch_id: str) -> dict[int, dict[str, Any]]:
    """Every answered line of the batch, by line number: `{kind, line}`."""
    found: dict[int, dict[str, Any]] = {}
    async for number, entry in client.hscan_iter(keys.batch_results(batch_id), count=1000):
        found[int(number)] = json.loads(entry)
    return found


async def cleared(client: aioredis.Redis, batch_id: str, model: str | None) -> None:
    """Deletes what the batch kept while it ran, once it has ended."""
    released: list[str] = await client.zrange(keys.batch_released(batch_id), 0, -1)  # type: ignore[assignment]
    pipe = client.pipeline(transaction=True)
    if model and released:
        pipe.zrem(keys.batch_lines(model), *(member(batch_id, int(n)) for n in released))
    pipe.delete(keys.batch_results(batch_id), keys.batch_released(batch_id))
    pipe.zrem(keys.batches_running(), batch_id)
    await pipe.execute()
