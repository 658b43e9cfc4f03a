"""The holding worker's job transitions, a Lua script each beside its typed caller: a job claimed, each step's
events appended to their jobs' logs and published, and a job's record written, its last write ending it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import orjson
import redis
from redis.client import Pipeline

from chatq.core import fair, keys, usage
from chatq.core.job import Event
from chatq.core.lua import EXTEND, PUSH_WEBHOOKS, Script, flat
from chatq.core.queue import BATCH_LANE

_CLAIM = Script(
    keys=(
        "job",
        "queued",
        "cancels",  # the claiming worker's cancel set
        "running",  # the model's running set
        "dispatched",  # the model's jobs dispatched by the fair share, not yet claimed
    ),
    args=(
        "worker",
        "now",
        "job_id",
        "lane",  # the priority lane the task came in
        "delivery",  # the task's kombu delivery tag
    ),
    body="""
redis.call('SREM', dispatched, job_id)
if redis.call('HGET', job, 'status') ~= 'queued' then return {} end
redis.call('HSET', job, 'status', 'in_progress', 'worker', worker, 'started', now, 'lane', lane, 'delivery', delivery)
redis.call('HINCRBY', job, 'attempts', 1)
redis.call('ZREM', queued, job_id)
redis.call('SADD', running, job_id)
if redis.call('HEXISTS', job, 'cancel') == 1 then
  redis.call('SADD', cancels, job_id)
else
  redis.call('SREM', cancels, job_id)
end
return redis.call('HGETALL', job)
""",
)


def claim(
    client: redis.Redis, job_id: str, model: str, worker: str, lane: int = 0, delivery: str = ""
) -> dict[str, str]:
    """The job's record, now held by `worker`; empty when the job is not this worker's to run (cancelled, expired,
    held by another). A cancel asked of an earlier holder (which died or handed the job back) carries over to this
    one; one left in this worker's set for an earlier job of the same id (deleted, then submitted again) does not."""
    record = _CLAIM.run(
        client,
        job=keys.job(job_id),
        queued=keys.queued(model),
        cancels=keys.cancels(worker),
        running=keys.running(model),
        dispatched=keys.dispatched(model),
        worker=worker,
        now=time.time(),
        job_id=job_id,
        lane=lane,
        delivery=delivery,
    )
    return dict(zip(record[::2], record[1::2], strict=True))


# Returns {the logs holding another type of value, the records of jobs the worker no longer holds}.
_PUBLISH_EVENTS = Script(
    keys=(),
    key_tail="event_keys",  # in threes, one per event: its job's record, event log, live channel
    args=("worker",),  # the writing worker
    tail="entries",  # in pairs, one per event: its entry id 0-<seq>, its message
    body="""
local refused, lost, held = {}, {}, {}
for k = 1, #entries / 2 do
  local job, log, live = event_keys[3 * k - 2], event_keys[3 * k - 1], event_keys[3 * k]
  local id, msg = entries[2 * k - 1], entries[2 * k]
  if held[job] == nil then
    local h = redis.pcall('HMGET', job, 'status', 'worker')
    -- A record of another type names no holder: its job's events still go out, whatever became of its writes.
    held[job] = h.err ~= nil or (h[1] and h[1] ~= 'queued' and (not h[2] or h[2] == worker))
    if not held[job] then lost[#lost + 1] = job end
  end
  if held[job] then
    local added = redis.pcall('XADD', log, id, 'msg', msg)
    local err = type(added) == 'table' and added.err
    if err then
      -- Redis 6 words a refusal raised inside a script "@user_script: 4: -READONLY ...": keep "READONLY ...", whose
      -- first word is what clients read the kind of error from.
      err = err:gsub('^@[^:]*:%s*%d+:%s*', ''):gsub('^%-', ''):gsub('%s+$', '')
    end
    if not err then
      redis.call('PUBLISH', live, msg)
    elseif string.sub(err, 1, 9) == 'WRONGTYPE' then
      refused[#refused + 1] = log
      redis.call('PUBLISH', live, msg)
    elseif not string.find(err, 'equal or smaller', 1, true) then
      return redis.error_reply(err)
    end
  end
end
return {refused, lost}
""",
)


def publish_events(pipe: Pipeline, worker: str, events: Iterable[tuple[str, Event]]) -> None:
    """Appends each (job id, event) to the job's log and publishes it, in one call; the reply lists the logs holding
    another type of value, and the records of jobs `worker` no longer holds.

    An event already logged is skipped, so a step resent after a lost reply is written once. Every event of a job
    whose record is gone (its last write landed), or that another worker took over (this one was counted dead, or
    handed the job back), is skipped too: one holder writes a job's log. A log that cannot take an entry costs its
    job the replay, not other jobs their events: the event is still published.
    """
    event_keys: list[str] = []
    entries: list[str | bytes] = []
    for job_id, event in events:
        event_keys += [keys.job(job_id), keys.events(job_id), keys.live(job_id)]
        entries += [f"0-{event.seq}", event.to_json()]
    _PUBLISH_EVENTS.run_in(pipe, event_keys=event_keys, worker=worker, entries=entries)


# Returns 0 when the job is not the worker's to write (any more), else 1.
_UPDATE_RECORD = Script(
    keys=(
        "job",
        "events",
        "running",  # the model's running set
        "metrics",  # the model's metrics hash
        # The model's fair share (chatq.core.fair.dispatch_keys): a job's end settles its charge and frees a slot.
        "dispatched",
        "workers",
        "service",
        "clock",
    ),
    args=(
        "worker",  # the writing worker
        "job_id",
        "ttl",  # seconds
        "last",  # "1" for the job's last write, "0" for progress
        "webhooks",  # the webhook block, which the last write sends once
        "increments",  # the last write's additions to the metrics hash: a JSON object of field -> amount (a string)
        "usage_prefix",  # keys.usage(day, ""): the day's usage of the job's owner, completed with the owner
        "total_prefix",  # keys.usage(usage.TOTAL, ""): the owner's usage since it began, likewise
        "usage",  # the last write's additions to that usage: a JSON object of measure -> amount
        "usage_ttl",
        "worker_prefix",
        "waiting_prefix",
        "parked_prefix",
        "job_prefix",
        "lanes",
        "now",
        "worker_ttl",
    ),
    tail="fields",  # the record's field/value pairs
    uses=(EXTEND, PUSH_WEBHOOKS, fair.FAIR_SETTLE, fair.FAIR_DISPATCH),
    body="""
redis.call('EXPIRE', events, ttl)
local h = redis.call('HMGET', job, 'status', 'worker', 'deleted', 'idem', 'index')
if not h[1] or h[1] == 'queued' or (h[2] and h[2] ~= worker) then return 0 end
if last == '1' then
  redis.call('SREM', running, job_id)
  -- Counted once: a last write sent again (its reply lost) finds the job ended.
  if h[1] == 'in_progress' then
    for name, amount in pairs(cjson.decode(increments)) do redis.call('HINCRBYFLOAT', metrics, name, amount) end
    local who = redis.call('HMGET', job, 'owner', 'model')
    local used, total, model = usage_prefix .. (who[1] or ''), total_prefix .. (who[1] or ''), who[2] or ''
    for name, amount in pairs(cjson.decode(usage)) do
      redis.call('HINCRBY', used, model .. '|' .. name, amount)
      redis.call('HINCRBY', total, model .. '|' .. name, amount)
    end
    redis.call('EXPIRE', used, usage_ttl)
    local spent = cjson.decode(usage)
    fair_settle(service, waiting_prefix, tonumber(lanes), job, spent.input_tokens, spent.output_tokens)
    """
    + fair.DISPATCH_CALL
    + """
  end
end
if h[3] then
  if last == '1' then redis.call('DEL', job, events) end
  return 1
end
redis.call('HSET', job, unpack(fields))
if last == '1' then
  -- Sent once, like the metrics; a deleted job (above) sends none.
  if h[1] == 'in_progress' then push_webhooks(webhooks, job, redis.call('HGET', job, 'status')) end
  redis.call('EXPIRE', job, ttl)
  if h[4] then redis.call('EXPIRE', h[4], ttl) end
  if h[5] then extend(h[5], ttl) end
end
return 1
""",
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
    worker_ttl: float = 0,
) -> None:
    """Writes the worker's fields into the job's record; the last write starts its expiry, takes the job off the
    model's running set, adds `metrics` (field -> amount) to the model's metrics hash (chatq.core.metrics) and the
    job's usage to its owner's (chatq.core.usage) and, for a background job, pushes its `webhook` messages
    (chatq.core.webhooks.WebhookMessages.block).

    The log's expiry is refreshed first, so the log of a job whose worker vanished still expires. A record deleted
    meanwhile stays gone rather than come back holding only these fields; one hidden by DELETE is removed with its
    log at the last write. A job another worker took over is left to it, and counted by it. The last write of a job
    that ran settles its owner's fair share and dispatches what waits for the slot it frees (chatq.core.fair), among
    the workers whose heartbeat is younger than `worker_ttl`.
    """
    # Each amount as Python writes it, for HINCRBYFLOAT to read as written: a number cjson decoded would reach Redis
    # rounded differently.
    increments = {name: repr(float(amount)) for name, amount in (metrics or {}).items()}
    _UPDATE_RECORD.run_in(
        pipe,
        job=keys.job(job_id),
        events=keys.events(job_id),
        metrics=keys.metrics(model),
        worker=worker,
        job_id=job_id,
        ttl=ttl,
        last=int(last),
        webhooks=webhook,
        increments=orjson.dumps(increments),
        usage_prefix=keys.usage(usage.day(time.time()), ""),
        total_prefix=keys.usage(usage.TOTAL, ""),
        usage=orjson.dumps(usage.measures(metrics or {})),
        usage_ttl=usage.KEPT_DAYS * 86400,
        **fair.dispatch_keys(model),
        lanes=BATCH_LANE,
        now=time.time(),
        worker_ttl=worker_ttl,
        fields=flat(fields),
    )
