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

import redis
import redis.asyncio as aioredis
from redis.client import Pipeline

from chatq.core import keys
from chatq.core.job import Event

# KEYS: job, waiting zset, Celery queue list, idempotency key. ARGV: job id, score, task message, the cap on waiting
# jobs (0: none), keys.job(""), "1" when the request has an idempotency key, then the record's field/value pairs.
# Returns {"queued", rank}, {"existing", id}, {"full"} or {"taken"}. The idempotent job's record key is completed
# from the idempotency key's value, which Redis Cluster forbids (as the cancel script does).
_SUBMIT = """
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
redis.call('HSET', KEYS[1], 'id', ARGV[1], unpack(ARGV, 7))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[3])
if idem then redis.call('SET', KEYS[4], ARGV[1]) end
return {'queued', redis.call('ZRANK', KEYS[2], ARGV[1])}
"""


class Outcome(StrEnum):
    queued = "queued"  # recorded and enqueued
    existing = "existing"  # the idempotency key names a live job: nothing was written
    full = "full"  # too many jobs wait for the model: nothing was written
    taken = "taken"  # the job id belongs to another job: nothing was written


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
) -> Submitted:
    """Records the job and pushes its Celery task message in one step, so no job exists that no worker will get.

    In the same step: a job the idempotency key already names is answered instead, a queue holding `max_queued`
    waiting jobs refuses it (so many APIs together never overshoot), and a taken id is refused (a repeated
    request_id never overwrites a job). `idem` is the idempotency key's Redis key (keys.idempotency); it is the
    record's `idem` field too, set with no expiry: the job's end expires it.
    """
    script = client.register_script(_SUBMIT)
    fields = {**record, "idem": idem} if idem else record
    flags: list[str | int] = [max_queued, keys.job(""), "1" if idem else "0"]
    reply = await script(
        # Without an idempotency key, the fourth key is never touched: the record's name stands in.
        keys=[keys.job(job_id), keys.waiting(model), queue, idem or keys.job(job_id)],
        args=[job_id, score, message, *flags, *_flat(fields)],
    )
    outcome = Outcome(reply[0])
    if outcome is Outcome.existing:
        return Submitted(outcome, reply[1])
    return Submitted(outcome, job_id, reply[1] if outcome is Outcome.queued else None)


# KEYS: job, waiting zset, the claiming worker's cancel set. ARGV: worker name, now, job id.
_CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return {} end
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'worker', ARGV[1], 'started', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('SREM', KEYS[3], ARGV[3])
return redis.call('HGETALL', KEYS[1])
"""


def claim(client: redis.Redis, job_id: str, model: str, worker: str) -> dict[str, str]:
    """The job's record, now held by `worker`; empty when the job is not this worker's to run (cancelled, expired,
    held by another). A cancel recorded for this id before the claim was for an earlier job of the same id
    (deleted, then submitted again): it must not stop this one."""
    claim_keys = (keys.job(job_id), keys.waiting(model), keys.cancels(worker))
    record = client.eval(_CLAIM, len(claim_keys), *claim_keys, worker, time.time(), job_id)
    return dict(zip(record[::2], record[1::2], strict=True))  # type: ignore[index]


# KEYS: job, events, live. ARGV: ttl, job id, keys.cancels(""), "1" to delete, keys.waiting(""), then a queued
# job's closing events. The prefixes are completed from the record, which Redis Cluster forbids.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then return nil end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled')
  local model = redis.call('HGET', KEYS[1], 'model')
  if model then redis.call('ZREM', ARGV[5] .. model, ARGV[2]) end
  for i = 6, #ARGV do
    redis.pcall('XADD', KEYS[2], '0-' .. (i - 5), 'msg', ARGV[i])
    redis.call('PUBLISH', KEYS[3], ARGV[i])
  end
  for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
  local idem = redis.call('HGET', KEYS[1], 'idem')
  if idem then redis.call('EXPIRE', idem, ARGV[1]) end
elseif status == 'in_progress' then
  local worker = redis.call('HGET', KEYS[1], 'worker')
  if not worker then return redis.error_reply('ERR running job ' .. ARGV[2] .. ' names no worker') end
  redis.call('SADD', ARGV[3] .. worker, ARGV[2])
  redis.call('EXPIRE', ARGV[3] .. worker, ARGV[1])
end
if ARGV[4] == '1' then
  local idem = redis.call('HGET', KEYS[1], 'idem')
  if idem then redis.call('DEL', idem) end
  if status == 'in_progress' then
    redis.call('HSET', KEYS[1], 'deleted', '1')
    for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
  else
    redis.call('DEL', KEYS[1], KEYS[2])
  end
end
return status
"""


async def cancel(client: aioredis.Redis, job_id: str, ttl: int, delete: bool, closing: Sequence[Event]) -> str | None:
    """Cancels the job; the status it had, None for no such job.

    A queued job is cancelled here, its log closed with `closing`; a running one is added to its worker's cancel set,
    which stops it at the next step. Deleted, a job is gone for readers at once; a running one's record and log stay
    hidden until its worker's last write removes them, so a job resubmitted under its id never meets the old run's
    writes.
    """
    script = client.register_script(_CANCEL)
    args = [ttl, job_id, keys.cancels(""), "1" if delete else "0", keys.waiting(""), *(e.to_json() for e in closing)]
    return await script(keys=[keys.job(job_id), keys.events(job_id), keys.live(job_id)], args=args)


# KEYS in threes (a job's record, its event log, its live channel), ARGV in pairs (the entry id 0-<seq>, the message).
_PUBLISH_EVENTS = """
local refused, exists = {}, {}
for k = 1, #ARGV / 2 do
  local job, i = KEYS[3 * k - 2], 2 * k - 1
  if exists[job] == nil then exists[job] = redis.call('EXISTS', job) == 1 end
  if exists[job] then
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
return refused
"""


def publish_events(pipe: Pipeline, events: Iterable[tuple[str, Event]]) -> None:
    """Appends each (job id, event) to the job's log and publishes it, in one call; the reply lists the logs holding
    another type of value.

    An event already logged is skipped, so a step resent after a lost reply is written once; every event of a job
    whose record is gone (its last write landed) is skipped too. A log that cannot take an entry costs its job the
    replay, not other jobs their events: the event is still published.
    """
    event_keys: list[str] = []
    args: list[str | bytes] = []
    for job_id, event in events:
        event_keys += [keys.job(job_id), keys.events(job_id), keys.live(job_id)]
        args += [f"0-{event.seq}", event.to_json()]
    pipe.eval(_PUBLISH_EVENTS, len(event_keys), *event_keys, *args)


# KEYS: job, events. ARGV: ttl in seconds, "1" for the job's last write ("0": progress), then field/value pairs.
_UPDATE_RECORD = """
redis.call('EXPIRE', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then
  if ARGV[2] == '1' then redis.call('DEL', KEYS[1], KEYS[2]) end
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
if ARGV[2] == '1' then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  local idem = redis.call('HGET', KEYS[1], 'idem')
  if idem then redis.call('EXPIRE', idem, ARGV[1]) end
end
return 1
"""


def update_record(pipe: Pipeline, job_id: str, ttl: int, fields: Mapping[str, str | bytes | int], last: bool) -> None:
    """Writes the worker's fields into the job's record; the last write starts its expiry.

    The log's expiry is refreshed first, so the log of a job whose worker vanished still expires. A record deleted
    meanwhile stays gone rather than come back holding only these fields; one hidden by DELETE is removed with its
    log at the last write.
    """
    pipe.eval(_UPDATE_RECORD, 2, keys.job(job_id), keys.events(job_id), ttl, int(last), *_flat(fields))


def _flat(fields: Mapping[str, str | bytes | int]) -> list[str | bytes | int]:
    return [x for pair in fields.items() for x in pair]
