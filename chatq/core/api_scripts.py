"""The API's job transitions, a Lua script each beside its typed caller: a job submitted (recorded, queued and its
task message pushed in one step) and cancelled (a queued one ended, a running one flagged to its worker)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import redis.asyncio as aioredis

from chatq.core import fair, keys
from chatq.core.job import Event
from chatq.core.lua import EXTEND, PUSH_WEBHOOKS, Script, flat
from chatq.core.queue import BATCH_LANE, lane_score

# Returns {"queued", rank}, {"existing", id}, {"full"}, {"busy"} or {"taken"}. The idempotent job's record key and
# the keys of the owner's jobs in flight are completed from their ids, which Redis Cluster forbids (as the cancel
# script does).
_SUBMIT = Script(
    keys=(
        "job",
        "queued",
        "task_queue",  # the Celery queue's list
        "idem",  # the idempotency key; the record's key when the request has none
        "owner_jobs",  # the owner's list of jobs; the record's key when the job is not listed
        "in_flight",  # the owner's jobs queued or running, when it has a cap on them; the record's key otherwise
        # With a fair share (chatq.core.fair): the job's lane's waiting owners, the owner's parked jobs there, and the
        # model's dispatch keys (fair.dispatch_keys); the record's key for each when the job goes straight to Celery.
        "waiting",
        "parked",
        "running",
        "dispatched",
        "workers",
        "service",
        "clock",
    ),
    args=(
        "job_id",
        "score",
        "task",  # the Celery task message
        "max_queued",  # the cap on queued jobs; 0: none
        "max_in_flight",  # the cap on the owner's jobs queued or running; 0: none
        "in_flight_ttl",
        "fair",  # "1": the job is parked and dispatched by its owner's fair share; "0": its message goes to its lane
        "owner",
        "worker_prefix",
        "waiting_prefix",
        "parked_prefix",
        "lanes",
        "worker_ttl",  # a worker's heartbeat's age past which it holds no slots
        "batch_floor",  # the lowest score of a batch line, which the cap does not count
        "job_prefix",  # keys.job("")
        "has_idem",  # "1" when the request has an idempotency key
        "listed",  # "1" when the job is listed
        "keep",  # how many of the owner's newest jobs the list keeps
        "list_ttl",
        "now",
    ),
    tail="fields",  # the record's field/value pairs
    uses=(EXTEND, fair.FAIR_PARK, fair.FAIR_DISPATCH),
    body="""
if has_idem == '1' then
  local existing = redis.call('GET', idem)
  if existing then
    local record = job_prefix .. existing
    if redis.call('EXISTS', record) == 1 and redis.call('HEXISTS', record, 'deleted') == 0 then
      return {'existing', existing}
    end
  end
end
if redis.call('EXISTS', job) == 1 then return {'taken'} end
local cap = tonumber(max_queued)
if cap > 0 and redis.call('ZCOUNT', queued, '-inf', '(' .. batch_floor) >= cap then return {'full'} end
local flight = tonumber(max_in_flight)
if flight > 0 then
  -- Whatever ended, by any path, leaves here as its record says so: no end has to remember this set.
  for _, id in ipairs(redis.call('ZRANGE', in_flight, 0, -1)) do
    local status = redis.call('HGET', job_prefix .. id, 'status')
    if status ~= 'queued' and status ~= 'in_progress' then redis.call('ZREM', in_flight, id) end
  end
  if redis.call('ZCARD', in_flight) >= flight then return {'busy'} end
  redis.call('ZADD', in_flight, score, job_id)
  extend(in_flight, in_flight_ttl)
end
redis.call('HSET', job, 'id', job_id, unpack(fields))
redis.call('ZADD', queued, score, job_id)
if fair == '1' then
  redis.call('HSET', job, 'parked', '1')
  fair_park(waiting, parked, service, clock, owner, job_id)
  """
    + fair.DISPATCH_CALL
    + """
else
  redis.call('LPUSH', task_queue, task)
end
if has_idem == '1' then redis.call('SET', idem, job_id) end
if listed == '1' then
  redis.call('ZADD', owner_jobs, now, job_id)
  redis.call('ZREMRANGEBYRANK', owner_jobs, 0, -1 - tonumber(keep))
  extend(owner_jobs, list_ttl)
end
return {'queued', redis.call('ZRANK', queued, job_id)}
""",
)


def _parking_names(model: str, parking: Parking | None, record_key: str) -> dict[str, str | int | float]:
    """The submit script's keys and arguments of the fair share: the record's key for each key it need not touch."""
    return {
        "waiting": keys.fair_waiting(model, parking.lane) if parking else record_key,
        "parked": keys.fair_parked(model, parking.lane, parking.owner) if parking else record_key,
        **fair.dispatch_keys(model),
        "fair": "1" if parking else "0",
        "owner": parking.owner if parking else "",
        "lanes": BATCH_LANE,
        "worker_ttl": parking.worker_ttl if parking else 0,
    }


class Outcome(StrEnum):
    queued = "queued"  # recorded and enqueued
    existing = "existing"  # the idempotency key names a live job: nothing was written
    full = "full"  # too many jobs wait for the model: nothing was written
    busy = "busy"  # the owner has as many jobs in flight as it may: nothing was written
    taken = "taken"  # the job id belongs to another job: nothing was written


@dataclass(frozen=True, slots=True)
class Listing:
    """Where submit lists a job for its owner: the list (keys.owner_jobs), how many of its newest jobs it keeps, and
    its expiry, which every submit and every end of a listed job lengthens to at least that of a finished record."""

    key: str
    keep: int
    ttl: int


@dataclass(frozen=True, slots=True)
class InFlight:
    """An owner's cap on its jobs queued or running: the set of them (keys.in_flight), the cap, and the set's expiry,
    lengthened by each submit."""

    key: str
    cap: int
    ttl: int


@dataclass(frozen=True, slots=True)
class Parking:
    """A job that waits for a free slot in its owner's fair share (chatq.core.fair) rather than going to its lane
    at once: its owner, its lane, and how old a worker's heartbeat may be for its slots to count."""

    owner: str
    lane: int
    worker_ttl: float


@dataclass(frozen=True, slots=True)
class Submitted:
    outcome: Outcome
    job_id: str  # the existing job's, for Outcome.existing
    rank: int | None = None  # the job's rank among the queued jobs, for Outcome.queued


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
    in_flight: InFlight | None = None,
    parking: Parking | None = None,
) -> Submitted:
    """Records the job and pushes its Celery task message in one step, so no job exists that no worker will get.

    In the same step: a job the idempotency key already names is answered instead, a queue holding `max_queued`
    waiting jobs (batch lines aside: their runners bound them) refuses it (so many APIs together never overshoot),
    and a taken id is refused (a repeated request_id never overwrites a job). `idem` is the idempotency key's Redis
    key (keys.idempotency); it is the record's `idem` field too, set with no expiry: the job's end expires it. With a
    `listing`, the job joins its owner's list (named in the record's `index`), whose oldest jobs past `listing.keep`
    leave it. With `in_flight`, an owner with as many jobs queued or running as its cap is refused. With `parking`,
    the job's message waits in its owner's share and goes to its lane when a worker has a free slot (at once if one
    has).
    """
    fields = {**record, "idem": idem} if idem else dict(record)
    if listing is not None:
        fields["index"] = listing.key
    # A key the request has no use for is never touched: the record's name stands in.
    record_key = keys.job(job_id)
    reply = await _SUBMIT.run(
        client,
        job=record_key,
        queued=keys.queued(model),
        task_queue=queue,
        idem=idem or record_key,
        owner_jobs=listing.key if listing is not None else record_key,
        in_flight=in_flight.key if in_flight is not None else record_key,
        **_parking_names(model, parking, record_key),
        job_id=job_id,
        score=score,
        task=message,
        max_queued=max_queued,
        max_in_flight=in_flight.cap if in_flight is not None else 0,
        in_flight_ttl=in_flight.ttl if in_flight is not None else 0,
        batch_floor=lane_score(BATCH_LANE, 0),
        has_idem="1" if idem else "0",
        listed="1" if listing else "0",
        keep=listing.keep if listing else 0,
        list_ttl=listing.ttl if listing else 0,
        now=time.time(),
        fields=flat(fields),
    )
    outcome = Outcome(reply[0])
    if outcome is Outcome.existing:
        return Submitted(outcome, reply[1])
    return Submitted(outcome, job_id, reply[1] if outcome is Outcome.queued else None)


# Returns the status the job had, nil for no such job. The prefixes are completed from the record, which Redis
# Cluster forbids. A queued job cancelled counts in its model's metrics as ended by an abort (as in vLLM).
_CANCEL = Script(
    keys=("job", "events", "live"),
    args=(
        "ttl",
        "job_id",
        "cancels_prefix",  # keys.cancels("")
        "delete",  # "1" to delete
        "queued_prefix",  # keys.queued("")
        "metrics_prefix",  # keys.metrics("")
        "webhooks",  # the webhook block, sent when a queued job is cancelled, not deleted
    ),
    tail="closing",  # a queued job's closing events, in pairs: the entry id, the message
    uses=(EXTEND, PUSH_WEBHOOKS),
    body="""
local status = redis.call('HGET', job, 'status')
if not status or redis.call('HEXISTS', job, 'deleted') == 1 then return nil end
if status == 'queued' then
  redis.call('HSET', job, 'status', 'cancelled')
  local model = redis.call('HGET', job, 'model')
  if model then
    redis.call('ZREM', queued_prefix .. model, job_id)
    redis.call('HINCRBYFLOAT', metrics_prefix .. model, 'success:abort', 1)
  end
  for i = 1, #closing, 2 do
    redis.pcall('XADD', events, closing[i], 'msg', closing[i + 1])
    redis.call('PUBLISH', live, closing[i + 1])
  end
  redis.call('EXPIRE', job, ttl)
  redis.call('EXPIRE', events, ttl)
  local idem, index = unpack(redis.call('HMGET', job, 'idem', 'index'))
  if idem then redis.call('EXPIRE', idem, ttl) end
  if index then extend(index, ttl) end
  if delete ~= '1' then push_webhooks(webhooks, job, 'cancelled') end
elseif status == 'in_progress' then
  local worker = redis.call('HGET', job, 'worker')
  if not worker then return redis.error_reply('ERR running job ' .. job_id .. ' names no worker') end
  redis.call('HSET', job, 'cancel', '1')
  redis.call('SADD', cancels_prefix .. worker, job_id)
  redis.call('EXPIRE', cancels_prefix .. worker, ttl)
end
if delete == '1' then
  local idem, index = unpack(redis.call('HMGET', job, 'idem', 'index'))
  if idem then redis.call('DEL', idem) end
  if index then redis.call('ZREM', index, job_id) end
  if status == 'in_progress' then
    redis.call('HSET', job, 'deleted', '1')
    redis.call('EXPIRE', job, ttl)
    redis.call('EXPIRE', events, ttl)
  else
    redis.call('DEL', job, events)
  end
end
return status
""",
)


async def cancel(
    client: aioredis.Redis, job_id: str, ttl: int, delete: bool, closing: Sequence[Event], webhook: str = ""
) -> str | None:
    """Cancels the job; the status it had, None for no such job.

    A queued job is cancelled here, its log closed with `closing`; a running one is flagged and added to its worker's
    cancel set, which stops it at the next step (the flag, should another worker take the job over). Deleted, a job
    is gone for readers at once; a running one's record and log stay hidden until its worker's last write removes
    them, so a job resubmitted under its id never meets the old run's writes. A queued background job cancelled
    (not deleted) sends `webhook` (chatq.core.webhooks.WebhookMessages.block); a running one's worker sends its own.
    """
    return await _CANCEL.run(
        client,
        job=keys.job(job_id),
        events=keys.events(job_id),
        live=keys.live(job_id),
        ttl=ttl,
        job_id=job_id,
        cancels_prefix=keys.cancels(""),
        delete="1" if delete else "0",
        queued_prefix=keys.queued(""),
        metrics_prefix=keys.metrics(""),
        webhooks=webhook,
        closing=[x for e in closing for x in (f"0-{e.seq}", e.to_json())],
    )
