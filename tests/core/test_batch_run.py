"""A batch's plan puts lines that share a prompt's start together; a line's answer is kept once, in OpenAI's line
shape, and counted once, whatever repeats it."""

from __future__ import annotations

import asyncio
import json
import uuid

import redis
import redis.asyncio as aioredis

from chatq.core import batch_run, keys
from chatq.core.batch_run import PlanLine
from chatq.core.settings import Settings


def _line(number: int, system: str, user: str) -> tuple[int, str]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    return number, json.dumps(
        {"custom_id": f"c{number}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def test_the_plan_runs_lines_sharing_a_system_prompt_together_and_keeps_input_order_within():
    doc_a, doc_b = "Read this contract: " + "a" * 3000, "Read this report: " + "b" * 3000
    lines = [
        _line(1, doc_a, "Q1"),
        _line(2, doc_b, "Q1"),
        _line(3, doc_a, "Q2"),
        _line(4, doc_b, "Q2"),
        _line(5, doc_a, "Q0"),
    ]
    planned = [batch_run.read_plan_line(raw) for raw in batch_run.plan_lines(lines)]
    systems = [line.body["messages"][0]["content"] for line in planned]
    assert systems.count(doc_a) == 3 and len({s for s in systems[:3]}) == 1 and len({s for s in systems[3:]}) == 1
    assert sorted(line.number for line in planned) == [1, 2, 3, 4, 5]
    assert [line.custom_id for line in planned] == [f"c{line.number}" for line in planned]


def test_a_line_answered_twice_is_kept_and_counted_once(settings: Settings, r: redis.Redis):
    batch_id, model = f"batch_{uuid.uuid4().hex}", f"m-{uuid.uuid4().hex[:6]}"
    line = PlanLine(7, "mine", {})
    job_id = f"chatcmpl-{line.job_request_id(batch_id)}"
    r.hset(keys.job(job_id), "status", "completed")
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
    answer = batch_run.answered(batch_id, line, job_id, 200, {"id": job_id, "usage": usage})
    assert answer.line == {
        "id": batch_run.line_id(batch_id, 7),
        "custom_id": "mine",
        "response": {"status_code": 200, "request_id": job_id, "body": {"id": job_id, "usage": usage}},
        "error": None,
    }

    async def twice() -> list[int]:
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        try:
            await batch_run.release(client, batch_id, model, 7, 1, 1.0)
            return [await batch_run.answer(client, batch_id, model, 7, answer, job_id) for _ in range(2)]
        finally:
            await client.aclose()

    assert asyncio.run(twice()) == [1, 0]
    record = r.hgetall(keys.batch(batch_id))
    assert (record["completed"], record["input_tokens"], record["cached_tokens"], record["output_tokens"]) == (
        "1",
        "5",
        "2",
        "3",
    )
    assert not r.exists(keys.job(job_id), keys.batch_released(batch_id)) and r.zcard(keys.batch_lines(model)) == 0
    assert json.loads(r.hget(keys.batch_results(batch_id), "7"))["line"] == answer.line
    r.delete(keys.batch(batch_id), keys.batch_results(batch_id))


def test_an_unanswered_line_has_an_error_and_no_response():
    line = batch_run.unanswered("batch_x", PlanLine(3, "c3", {}), "batch_expired", "The batch expired.")
    assert (line.kind, line.outcome) == ("error", "failed")
    assert line.line["response"] is None and line.line["error"] == {
        "code": "batch_expired",
        "message": "The batch expired.",
    }
