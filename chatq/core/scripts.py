"""Every atomic job transition, a Lua script each, beside its one typed caller.

The API's submit creates a record queued; its status then changes once per transition: queued -> in_progress (a
worker's claim), queued -> cancelled (the API), in_progress -> completed | failed | cancelled (the holding worker). The
worker's step scripts go by EVAL in its pipeline, as redis-py would send SCRIPT EXISTS before every execute: a
second round trip per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from redis.client import Pipeline

from chatq.core import keys
from chatq.core.job import Event
from chatq.core.queue import task_fields

# Lengthens a key's expiry to at least `ttl` seconds: a key without one gets it; a missing key stays missing.
_EXTEND = """
local function extend(key, ttl)
  if redis.call('TTL', key) < tonumber(ttl) then redis.call('EXPIRE', key, ttl) end
end
"""

# Pushes a background job's webhook messages (chatq.core.webhooks.Outbox.block, "" for none) onto the webhook queue,
# in the script that ends the job, so no end is lost between it and its webhook. The job's kind and its status
# complete each message; a job whose request is not a background one sends none. A response whose text ran out of
# tokens ended `incomplete`, as its Response says (chatq.core.responses.status_of). The queue is named in the block,
# not in KEYS, which Redis Cluster forbids (as the cancel script's completed prefixes).
_WEBHOOK = """
local function webhook(block, job, status)
  if block == '' then return end
  local h = redis.call('HMGET', job, 'kind', 'request')
  local kind = h[1] or 'chat'
  local ok, request = pcall(cjson.decode, h[2] or '')
  if not ok or type(request) ~= 'table' or request.background ~= true then return end
  if not string.match(kind, '^[%w_]+$') or not string.match(status, '^[%w_]+$') then return end
  if kind == 'response' and status == 'completed' then
    local decoded, result = pcall(cjson.decode, redis.call('HGET', job, 'result') or '')
    local choice = decoded and type(result) == 'table' and type(result.choices) == 'table' and result.choices[1]
    if type(choice) == 'table' and choice.finish_reason == 'length' then status = 'incomplete' end
  end
  local w = cjson.decode(block)
  for _, m in ipairs(w.messages) do redis.call('LPUSH', w.queue, m[1] .. kind .. '.' .. status .. m[2]) end
end
"""

# KEYS: job, waiting zset, Celery queue list, idempotency key, the owner's jobs list. ARGV: job id, score, task
# message, the cap on waiting jobs (0: none), keys.job(""), "1" when the request has an idempotency key, "1" when the
# job is listed, the list's length kept, its expiry, now, then the record's field/value pairs. Returns
# {"queued", rank}, {"existing", id}, {"full"} or {"taken"}. The idempotent job's record key is completed from the
# idempotency key's value, which Redis Cluster forbids (as the cancel script does).
_SUBMIT = (
    _EXTEND
    + """
local idem = ARGV[6] == '1'
if idem then
  local existing = redis.call('GET', KEYS[4])
  if existing then
    local record = ARGV[5] .. existing
    if redis.call('EXISTS', record) == 1 and redis.call('HEXISTS', record, 'deleted') == 0 then
      return {'existing', existing}
    end
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {'taken'} end
local cap = tonumber(ARGV[4])
if cap > 0 and redis.call('ZCARD', KEYS[2]) >= cap then return {'full'} end
redis.call('HSET', KEYS[1], 'id', ARGV[1], unpack(ARGV, 11))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[3])
if idem then redis.call('SET', KEYS[4], ARGV[1]) end
if ARGV[7] == '1' then
  redis.call('ZADD', KEYS[5], ARGV[10], ARGV[1])
  redis.call('ZREMRANGEBYRANK', KEYS[5], 0, -1 - tonumber(ARGV[8]))
  extend(KEYS[5], ARGV[9])
end
return {'queued', redis.call('ZRANK', KEYS[2], ARGV[1])}
"""
)


class Outcome(StrEnum):
    queued = "queued"  # recorded and enqueued
    existing = "existing"  # the idempotency key names a live job: nothing was written
    full = "full"  # too many jobs wait for the model: nothing was written
    taken = "taken"  # the job id belongs to another job: nothing was written


@dataclass(frozen=True, slots=True)
class Listing:
    """Where submit lists a job for its owner: the list (keys.owner_jobs), how many of its newest jobs it keeps, and
    its expiry, which every submit and every end of a listed job lengthens to at least that of a finished record."""

    key: str
    keep: int
    ttl: int


@dataclass(frozen=True, slots=True)
class Submitted:
    outcome: Outcome
    job_id: str  # the existing job's, for Outcome.existing
    rank: int | None = None  # the job's rank in the waiting set, for Outcome.queued


async def submit(
    client: aioredis.Redis,
    job_id: str,
    model: str,
    record: Mapping[str, str],
    queue: str,
    message: str,
    score: float,
    max_queued: int = 0,
    idem: str | None = None,
    listing: Listing | None = None,
) -> Submitted:
    """Records the job and pushes its Celery task message in one step, so no job exists that no worker will get.

    In the same step: a job the idempotency key already names is answered instead, a queue holding `max_queued`
    waiting jobs refuses it (so many APIs together never overshoot), and a taken id is refused (a repeated
    request_id never overwrites a job). `idem` is the idempotency key's Redis key (keys.idempotency); it is the
    record's `idem` field too, set with no expiry: the job's end expires it. With a `listing`, the job joins its
    owner's list (named in the record's `index`), whose oldest jobs past `listing.keep` leave it.
    """
    script = client.register_script(_SUBMIT)
    fields = {**record, "idem": idem} if idem else dict(record)
    if listing is not None:
        fields["index"] = listing.key
    flags: list[str | int | float] = [max_queued, keys.job(""), "1" if idem else "0", "1" if listing else "0"]
    flags += [listing.keep, listing.ttl, time.time()] if listing else [0, 0, 0]
    # A key the request has no use for is never touched: the record's name stands in.
    listed = listing.key if listing is not None else keys.job(job_id)
    reply = await script(
        keys=[keys.job(job_id), keys.waiting(model), queue, idem or keys.job(job_id), listed],
        args=[job_id, score, message, *flags, *_flat(fields)],
    )
    outcome = Outcome(reply[0])
    if outcome is Outcome.existing:
        return Submitted(outcome, reply[1])
    return Submitted(outcome, job_id, reply[1] if outcome is Outcome.queued else None)


# KEYS: job, waiting zset, the claiming worker's cancel set, the model's running set. ARGV: worker name, now, job id,
# the priority lane the task came in, its kombu delivery tag.
_CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return {} end
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'worker', ARGV[1], 'started', ARGV[2], 'lane', ARGV[4],
  'delivery', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[4], ARGV[3])
if redis.call('HEXISTS', KEYS[1], 'cancel') == 1 then
  redis.call('SADD', KEYS[3], ARGV[3])
else
  redis.call('SREM', KEYS[3], ARGV[3])
end
return redis.call('HGETALL', KEYS[1])
"""


def claim(
    client: redis.Redis, job_id: str, model: str, worker: str, lane: int = 0, delivery: str = ""
) -> dict[str, str]:
    """The job's record, now held by `worker`; empty when the job is not this worker's to run (cancelled, expired,
    held by another). A cancel asked of an earlier holder (which died or handed the job back) carries over to this
    one; one left in this worker's set for an earlier job of the same id (deleted, then submitted again) does not."""
    claim_keys = (keys.job(job_id), keys.waiting(model), keys.cancels(worker), keys.running(model))
    record = client.eval(_CLAIM, len(claim_keys), *claim_keys, worker, time.time(), job_id, lane, delivery)
    return dict(zip(record[::2], record[1::2], strict=True))  # type: ignore[index]


# KEYS: job, events, live, the model's live-worker registry, running set, waiting zset, kombu's unacked hash and
# index, the model's metrics hash (a job failed here counts as ended with an error). ARGV: job id, the holder it
# is taken from, now, worker ttl ("0": the holder hands it back itself), max attempts, score, queue, task message,
# result ttl, the error event's data and the record's error (should the job have run out of attempts), the webhook
# block (sent should it fail here), then the queued job's task fields.
_RECLAIM = (
    _EXTEND
    + _WEBHOOK
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'worker', 'attempts', 'deleted', 'delivery', 'index', 'idem')
if h[1] ~= 'in_progress' or h[2] ~= ARGV[2] then return nil end
if ARGV[4] ~= '0' then
  local beat = redis.call('ZSCORE', KEYS[4], ARGV[2])
  if beat and tonumber(beat) >= tonumber(ARGV[3]) - tonumber(ARGV[4]) then return nil end
end
redis.call('SREM', KEYS[5], ARGV[1])
-- The holder's Celery message, never to be acknowledged now: gone, rather than delivered again hours later.
if h[5] and h[5] ~= '' then
  redis.call('HDEL', KEYS[7], h[5])
  redis.call('ZREM', KEYS[8], h[5])
end
if h[4] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 'deleted'
end
if ARGV[4] == '0' then
  redis.call('HINCRBY', KEYS[1], 'attempts', -1)
elseif tonumber(h[3] or '0') >= tonumber(ARGV[5]) then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  local seq = 0
  if #last > 0 then seq = tonumber(string.match(last[1][1], '%-(%d+)$')) end
  local msgs = {
    '{"seq":' .. (seq + 1) .. ',"event":"error","data":' .. ARGV[10] .. '}',
    '{"seq":' .. (seq + 2) .. ',"event":"done","data":null}',
  }
  for i, msg in ipairs(msgs) do
    redis.call('XADD', KEYS[2], '0-' .. (seq + i), 'msg', msg)
    redis.call('PUBLISH', KEYS[3], msg)
  end
  redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[11], 'finished', ARGV[3])
  for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[9]) end
  if h[6] then extend(h[6], ARGV[9]) end
  if h[7] then redis.call('EXPIRE', h[7], ARGV[9]) end
  redis.call('HINCRBYFLOAT', KEYS[9], 'success:error', 1)
  webhook(ARGV[12], KEYS[1], 'failed')
  return 'failed'
end
redis.call('HSET', KEYS[1], 'status', 'queued', unpack(ARGV, 13))
redis.call('HDEL', KEYS[1], 'worker')
redis.call('PERSIST', KEYS[2])
redis.call('ZADD', KEYS[6], ARGV[6], ARGV[1])
redis.call('RPUSH', ARGV[7], ARGV[8])  -- the end workers pop from: it has waited once already
return 'queued'
"""
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
    # When the task counts as sent, for the sweep that sends a lost one again (scripts.redeliver); a stopping
    # worker's hand-back dates it a worker TTL back, as the stopping worker's own pending read may take it.
    queued_at: float = 0.0
    webhook: str = ""  # the webhooks its failure sends (chatq.core.webhooks.Outbox.block)


def reclaim(client: redis.Redis, job_id: str, model: str, holder: str, worker_ttl: float, how: Requeue) -> str | None:
    """Takes a running job from `holder`, a worker out of the model's live registry for `worker_ttl` seconds (0:
    the holder itself, handing it back): queued again for the next worker, which continues where the log stops,
    or failed once its attempts ran out. What became of it, or None when it was not `holder`'s to lose (ended,
    reclaimed by someone else, its holder alive again). One script, so two sweepers never requeue a job twice."""
    job_keys = [keys.job(job_id), keys.events(job_id), keys.live(job_id), keys.workers(model)]
    job_keys += [keys.running(model), keys.waiting(model), keys.KOMBU_UNACKED, keys.KOMBU_UNACKED_INDEX]
    job_keys += [keys.metrics(model)]
    args = (job_id, holder, time.time(), worker_ttl, how.max_attempts, how.score, how.queue, how.message)
    errors = (orjson.dumps(how.error), orjson.dumps(how.error["error"]))
    task = _flat(task_fields(how.queue, how.message, how.queued_at or time.time()))
    tail = (how.result_ttl, *errors, how.webhook, *task)
    return client.eval(_RECLAIM, len(job_keys), *job_keys, *args, *tail)  # type: ignore[return-value]


# KEYS: job, its task's queue list, kombu's unacked hash and index. ARGV: the task's delivery tag as read, now, the
# age past which a task is missing.
_REDELIVER = """
local h = redis.call('HMGET', KEYS[1], 'status', 'tag', 'queued_at', 'task')
if h[1] ~= 'queued' or h[2] ~= ARGV[1] or not h[4] then return 0 end
local now, age = tonumber(ARGV[2]), tonumber(ARGV[3])
if now - tonumber(h[3]) < age then return 0 end
if redis.call('LPOS', KEYS[2], h[4], 'RANK', -1) then return 0 end
local delivered = redis.call('ZSCORE', KEYS[4], h[2])
if delivered and now - tonumber(delivered) < age then return 0 end
redis.call('HDEL', KEYS[3], h[2])
redis.call('ZREM', KEYS[4], h[2])
redis.call('RPUSH', KEYS[2], h[4])
redis.call('HSET', KEYS[1], 'queued_at', ARGV[2])
return 1
"""


def redeliver(client: redis.Redis, job_id: str, queue: str, tag: str, age: float) -> bool:
    """Sends a queued job's task message (the one its record keeps) again if it went missing: not in its queue, and
    not delivered to a worker in the last `age` seconds (a live worker claims what it is given at once); its stale
    delivery, if any, is dropped first, so the tag is its own again. Whether it was sent again.

    kombu pops a task and then records it as delivered: a worker that dies in between (or a connection Redis still
    served a blocked pop on) takes the message with it, and the job would wait for ever."""
    job_keys = (keys.job(job_id), queue, keys.KOMBU_UNACKED, keys.KOMBU_UNACKED_INDEX)
    return bool(client.eval(_REDELIVER, len(job_keys), *job_keys, tag, time.time(), age))


# KEYS: job, events, live. ARGV: ttl, job id, keys.cancels(""), "1" to delete, keys.waiting(""), keys.metrics(""),
# the webhook block (a queued job cancelled, not deleted, sends it), then a queued job's closing events in pairs
# (entry id, message). The prefixes are completed from the record, which
# Redis Cluster forbids. A queued job cancelled counts in its model's metrics as ended by an abort (as in vLLM).
_CANCEL = (
    _EXTEND
    + _WEBHOOK
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then return nil end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled')
  local model = redis.call('HGET', KEYS[1], 'model')
  if model then
    redis.call('ZREM', ARGV[5] .. model, ARGV[2])
    redis.call('HINCRBYFLOAT', ARGV[6] .. model, 'success:abort', 1)
  end
  for i = 8, #ARGV, 2 do
    redis.pcall('XADD', KEYS[2], ARGV[i], 'msg', ARGV[i + 1])
    redis.call('PUBLISH', KEYS[3], ARGV[i + 1])
  end
  for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
  local idem, index = unpack(redis.call('HMGET', KEYS[1], 'idem', 'index'))
  if idem then redis.call('EXPIRE', idem, ARGV[1]) end
  if index then extend(index, ARGV[1]) end
  if ARGV[4] ~= '1' then webhook(ARGV[7], KEYS[1], 'cancelled') end
elseif status == 'in_progress' then
  local worker = redis.call('HGET', KEYS[1], 'worker')
  if not worker then return redis.error_reply('ERR running job ' .. ARGV[2] .. ' names no worker') end
  redis.call('HSET', KEYS[1], 'cancel', '1')
  redis.call('SADD', ARGV[3] .. worker, ARGV[2])
  redis.call('EXPIRE', ARGV[3] .. worker, ARGV[1])
end
if ARGV[4] == '1' then
  local idem, index = unpack(redis.call('HMGET', KEYS[1], 'idem', 'index'))
  if idem then redis.call('DEL', idem) end
  if index then redis.call('ZREM', index, ARGV[2]) end
  if status == 'in_progress' then
    redis.call('HSET', KEYS[1], 'deleted', '1')
    for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
  else
    redis.call('DEL', KEYS[1], KEYS[2])
  end
end
return status
"""
)


async def cancel(
    client: aioredis.Redis, job_id: str, ttl: int, delete: bool, closing: Sequence[Event], webhook: str = ""
) -> str | None:
    """Cancels the job; the status it had, None for no such job.

    A queued job is cancelled here, its log closed with `closing`; a running one is flagged and added to its worker's
    cancel set, which stops it at the next step (the flag, should another worker take the job over). Deleted, a job
    is gone for readers at once; a running one's record and log stay hidden until its worker's last write removes
    them, so a job resubmitted under its id never meets the old run's writes. A queued background job cancelled
    (not deleted) sends `webhook` (chatq.core.webhooks.Outbox.block); a running one's worker sends its own.
    """
    script = client.register_script(_CANCEL)
    closing_args = [x for e in closing for x in (f"0-{e.seq}", e.to_json())]
    args: list[str | bytes | int] = [ttl, job_id, keys.cancels(""), "1" if delete else "0", keys.waiting("")]
    args += [keys.metrics(""), webhook, *closing_args]
    return await script(keys=[keys.job(job_id), keys.events(job_id), keys.live(job_id)], args=args)


# KEYS in threes (a job's record, its event log, its live channel). ARGV: the writing worker, then pairs (the entry
# id 0-<seq>, the message).
_PUBLISH_EVENTS = """
local refused, lost, held = {}, {}, {}
for k = 1, (#ARGV - 1) / 2 do
  local job, i = KEYS[3 * k - 2], 2 * k
  if held[job] == nil then
    local h = redis.pcall('HMGET', job, 'status', 'worker')
    -- A record of another type names no holder: its job's events still go out, whatever became of its writes.
    held[job] = h.err ~= nil or (h[1] and h[1] ~= 'queued' and (not h[2] or h[2] == ARGV[1]))
    if not held[job] then lost[#lost + 1] = job end
  end
  if held[job] then
    local log, live = KEYS[3 * k - 1], KEYS[3 * k]
    local added = redis.pcall('XADD', log, ARGV[i], 'msg', ARGV[i + 1])
    local err = type(added) == 'table' and added.err
    if err then
      -- Redis 6 words a refusal raised inside a script "@user_script: 4: -READONLY ...": keep "READONLY ...", whose
      -- first word is what clients read the kind of error from.
      err = err:gsub('^@[^:]*:%s*%d+:%s*', ''):gsub('^%-', ''):gsub('%s+$', '')
    end
    if not err then
      redis.call('PUBLISH', live, ARGV[i + 1])
    elseif string.sub(err, 1, 9) == 'WRONGTYPE' then
      refused[#refused + 1] = log
      redis.call('PUBLISH', live, ARGV[i + 1])
    elseif not string.find(err, 'equal or smaller', 1, true) then
      return redis.error_reply(err)
    end
  end
end
return {refused, lost}
"""


def publish_events(pipe: Pipeline, worker: str, events: Iterable[tuple[str, Event]]) -> None:
    """Appends each (job id, event) to the job's log and publishes it, in one call; the reply lists the logs holding
    another type of value, and the records of jobs `worker` no longer holds.

    An event already logged is skipped, so a step resent after a lost reply is written once. Every event of a job
    whose record is gone (its last write landed), or that another worker took over (this one was counted dead, or
    handed the job back), is skipped too: one holder writes a job's log. A log that cannot take an entry costs its
    job the replay, not other jobs their events: the event is still published.
    """
    event_keys: list[str] = []
    args: list[str | bytes] = [worker]
    for job_id, event in events:
        event_keys += [keys.job(job_id), keys.events(job_id), keys.live(job_id)]
        args += [f"0-{event.seq}", event.to_json()]
    pipe.eval(_PUBLISH_EVENTS, len(event_keys), *event_keys, *args)


# KEYS: job, events, the model's running set, its metrics hash. ARGV: the writing worker, job id, ttl in seconds, "1"
# for the job's last write ("0": progress), the webhook block (the last write sends it once), the number of metric
# increments, those (field, amount) pairs, then the record's field/value pairs. Returns 0 when the job is not the
# worker's to write (any more).
_UPDATE_RECORD = (
    _EXTEND
    + _WEBHOOK
    + """
redis.call('EXPIRE', KEYS[2], ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'status', 'worker', 'deleted', 'idem', 'index')
if not h[1] or h[1] == 'queued' or (h[2] and h[2] ~= ARGV[1]) then return 0 end
local last = ARGV[4] == '1'
local fields = 7 + 2 * tonumber(ARGV[6])
if last then
  redis.call('SREM', KEYS[3], ARGV[2])
  -- Counted once: a last write sent again (its reply lost) finds the job ended.
  if h[1] == 'in_progress' then
    for i = 7, fields - 1, 2 do redis.call('HINCRBYFLOAT', KEYS[4], ARGV[i], ARGV[i + 1]) end
  end
end
if h[3] then
  if last then redis.call('DEL', KEYS[1], KEYS[2]) end
  return 1
end
redis.call('HSET', KEYS[1], unpack(ARGV, fields))
if last then
  -- Sent once, like the metrics; a deleted job (above) sends none.
  if h[1] == 'in_progress' then webhook(ARGV[5], KEYS[1], redis.call('HGET', KEYS[1], 'status')) end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  if h[4] then redis.call('EXPIRE', h[4], ARGV[3]) end
  if h[5] then extend(h[5], ARGV[3]) end
end
return 1
"""
)


def update_record(
    pipe: Pipeline,
    worker: str,
    job_id: str,
    model: str,
    ttl: int,
    fields: Mapping[str, str | bytes | int],
    last: bool,
    metrics: Mapping[str, float] | None = None,
    webhook: str = "",
) -> None:
    """Writes the worker's fields into the job's record; the last write starts its expiry, takes the job off the
    model's running set, adds `metrics` (field -> amount) to the model's metrics hash (chatq.core.metrics) and, for a
    background job, pushes its `webhook` messages (chatq.core.webhooks.Outbox.block).

    The log's expiry is refreshed first, so the log of a job whose worker vanished still expires. A record deleted
    meanwhile stays gone rather than come back holding only these fields; one hidden by DELETE is removed with its
    log at the last write. A job another worker took over is left to it, and counted by it.
    """
    job_keys = (keys.job(job_id), keys.events(job_id), keys.running(model), keys.metrics(model))
    added = [x for name, amount in (metrics or {}).items() for x in (name, repr(float(amount)))]
    args = (worker, job_id, ttl, int(last), webhook, len(added) // 2, *added, *_flat(fields))
    pipe.eval(_UPDATE_RECORD, len(job_keys), *job_keys, *args)


def _flat(fields: Mapping[str, str | bytes | int]) -> list[str | bytes | int]:
    return [x for pair in fields.items() for x in pair]
