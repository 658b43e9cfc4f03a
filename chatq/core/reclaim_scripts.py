"""The transitions of a job whose worker or task message was lost, a Lua script each beside its typed caller: a
running job taken from a dead (or stopping) holder and queued again, or failed once its attempts ran out; a queued
job's missing task message sent again."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from chatq.core import keys
from chatq.core.lua import EXTEND, PUSH_WEBHOOKS, LuaFunction, Script, flat
from chatq.core.queue import task_fields

# An event's envelope, as chatq.core.job.Event.to_json writes it: the one place Lua writes one. `data` is JSON text.
_ENVELOPE = LuaFunction("""
local function envelope(seq, kind, data)
  return '{"seq":' .. seq .. ',"event":"' .. kind .. '","data":' .. data .. '}'
end
""")


# Returns what became of the job: "queued", "failed", "deleted", or nil when it was not the holder's to lose. The
# queue and the record's idempotency key and owner's list are named outside KEYS, which Redis Cluster forbids.
_RECLAIM = Script(
    keys=(
        "job",
        "events",
        "live",
        "workers",  # the model's live-worker registry
        "running",
        "queued",
        "unacked",  # kombu's unacked hash
        "unacked_index",  # and its index
        "metrics",  # the model's metrics hash: a job failed here counts as ended with an error
    ),
    args=(
        "job_id",
        "holder",  # the worker it is taken from
        "now",
        "worker_ttl",  # "0": the holder hands it back itself
        "max_attempts",
        "score",
        "task_queue",
        "task",
        "result_ttl",
        "error_data",  # should the job have run out of attempts: its error event's data (JSON)
        "record_error",  # and its record's error (JSON)
        "webhooks",  # the webhook block, sent should it fail here
    ),
    tail="fields",  # the queued job's task fields, field/value pairs (chatq.core.queue.task_fields)
    uses=(EXTEND, PUSH_WEBHOOKS, _ENVELOPE),
    body="""
local h = redis.call('HMGET', job, 'status', 'worker', 'attempts', 'deleted', 'delivery', 'index', 'idem')
if h[1] ~= 'in_progress' or h[2] ~= holder then return nil end
if worker_ttl ~= '0' then
  local beat = redis.call('ZSCORE', workers, holder)
  if beat and tonumber(beat) >= tonumber(now) - tonumber(worker_ttl) then return nil end
end
redis.call('SREM', running, job_id)
-- The holder's Celery message, never to be acknowledged now: gone, rather than delivered again hours later.
if h[5] and h[5] ~= '' then
  redis.call('HDEL', unacked, h[5])
  redis.call('ZREM', unacked_index, h[5])
end
if h[4] then
  redis.call('DEL', job, events)
  return 'deleted'
end
if worker_ttl == '0' then
  redis.call('HINCRBY', job, 'attempts', -1)
elseif tonumber(h[3] or '0') >= tonumber(max_attempts) then
  local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
  local seq = 0
  if #last > 0 then seq = tonumber(string.match(last[1][1], '%-(%d+)$')) end
  local msgs = {envelope(seq + 1, 'error', error_data), envelope(seq + 2, 'done', 'null')}
  for i, msg in ipairs(msgs) do
    redis.call('XADD', events, '0-' .. (seq + i), 'msg', msg)
    redis.call('PUBLISH', live, msg)
  end
  redis.call('HSET', job, 'status', 'failed', 'error', record_error, 'finished', now)
  redis.call('EXPIRE', job, result_ttl)
  redis.call('EXPIRE', events, result_ttl)
  if h[6] then extend(h[6], result_ttl) end
  if h[7] then redis.call('EXPIRE', h[7], result_ttl) end
  redis.call('HINCRBYFLOAT', metrics, 'success:error', 1)
  push_webhooks(webhooks, job, 'failed')
  return 'failed'
end
redis.call('HSET', job, 'status', 'queued', unpack(fields))
redis.call('HDEL', job, 'worker')
redis.call('PERSIST', events)
redis.call('ZADD', queued, score, job_id)
redis.call('RPUSH', task_queue, task)  -- the end workers pop from: it has waited once already
return 'queued'
""",
)


@dataclass
class Requeue:
    """How a job taken from its holder is queued again: its task message and place, and how it fails instead."""

    queue: str
    message: str
    score: float
    max_attempts: int
    result_ttl: int
    error: Mapping[str, Any]  # OpenAI's error body
    # When the task counts as sent, for the sweep that sends a lost one again (redeliver); a stopping
    # worker's hand-back dates it a worker TTL back, as the stopping worker's own pending read may take it.
    queued_at: float = 0.0
    webhook: str = ""  # the webhooks its failure sends (chatq.core.webhooks.WebhookMessages.block)


def reclaim(client: redis.Redis, job_id: str, model: str, holder: str, worker_ttl: float, how: Requeue) -> str | None:
    """Takes a running job from `holder`, a worker out of the model's live registry for `worker_ttl` seconds (0:
    the holder itself, handing it back): queued again for the next worker, which continues where the log stops,
    or failed once its attempts ran out. What became of it, or None when it was not `holder`'s to lose (ended,
    reclaimed by someone else, its holder alive again). One script, so two sweepers never requeue a job twice."""
    return _RECLAIM.run(
        client,
        job=keys.job(job_id),
        events=keys.events(job_id),
        live=keys.live(job_id),
        workers=keys.workers(model),
        running=keys.running(model),
        queued=keys.queued(model),
        unacked=keys.KOMBU_UNACKED,
        unacked_index=keys.KOMBU_UNACKED_INDEX,
        metrics=keys.metrics(model),
        job_id=job_id,
        holder=holder,
        now=time.time(),
        worker_ttl=worker_ttl,
        max_attempts=how.max_attempts,
        score=how.score,
        task_queue=how.queue,
        task=how.message,
        result_ttl=how.result_ttl,
        error_data=orjson.dumps(how.error),
        record_error=orjson.dumps(how.error["error"]),
        webhooks=how.webhook,
        fields=flat(task_fields(how.queue, how.message, how.queued_at or time.time())),
    )


# Returns 1 when the task was sent again, else 0.
_REDELIVER = Script(
    keys=(
        "job",
        "task_queue",  # the task's queue list
        "unacked",  # kombu's unacked hash
        "unacked_index",  # and its index
    ),
    args=(
        "tag",  # the task's delivery tag as read
        "now",
        "age",  # seconds past which a task is missing
    ),
    body="""
local h = redis.call('HMGET', job, 'status', 'tag', 'queued_at', 'task', 'parked')
-- A parked job's message waits for its fair share's dispatch (chatq.core.fair), not for a worker.
if h[1] ~= 'queued' or h[2] ~= tag or not h[4] or h[5] then return 0 end
if tonumber(now) - tonumber(h[3]) < tonumber(age) then return 0 end
if redis.call('LPOS', task_queue, h[4], 'RANK', -1) then return 0 end
local delivered = redis.call('ZSCORE', unacked_index, h[2])
if delivered and tonumber(now) - tonumber(delivered) < tonumber(age) then return 0 end
redis.call('HDEL', unacked, h[2])
redis.call('ZREM', unacked_index, h[2])
redis.call('RPUSH', task_queue, h[4])
redis.call('HSET', job, 'queued_at', now)
return 1
""",
)


def redeliver(client: redis.Redis, job_id: str, queue: str, tag: str, age: float) -> bool:
    """Sends a queued job's task message (the one its record keeps) again if it went missing: not in its queue, and
    not delivered to a worker in the last `age` seconds (a live worker claims what it is given at once); its stale
    delivery, if any, is dropped first, so the tag is its own again. Whether it was sent again.

    kombu pops a task and then records it as delivered: a worker that dies in between (or a connection Redis still
    served a blocked pop on) takes the message with it, and the job would wait for ever."""
    return bool(
        _REDELIVER.run(
            client,
            job=keys.job(job_id),
            task_queue=queue,
            unacked=keys.KOMBU_UNACKED,
            unacked_index=keys.KOMBU_UNACKED_INDEX,
            tag=tag,
            now=time.time(),
            age=age,
        )
    )
