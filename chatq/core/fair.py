"""A fair share of each model's workers among API keys.

Within each priority lane, the next job a worker of the model gets is from the key that has had the least service
for its weight, as the flow-control designs pick (Gateway API inference extension, llm-d): service is tokens, a
prompt's plus twice its output, divided by the key's weight, charged as a job is dispatched (its prompt and
max_tokens) and set right as it ends. Each key's service is the start of its next job in a virtual time that the
dispatched jobs advance (start-time fair queuing); a key that was idle starts at the start of the job dispatched
last, so idling banks no credit, and a newcomer goes before the keys that kept the slots busy.

Celery stays the transport: a job's task message waits in its key's list of the lane ("parked") until a worker of
the model has a free slot, and goes to the lane's Celery list then ("dispatched"), so the choice is made as late as
it can be. It is work-conserving: a job is parked only while every slot of every live worker is taken, and a slot
that frees (a job's end) dispatches the next job in the same script. The lanes keep their strict order: a lane's
jobs go only when no lane before it has any parked.

The functions below run inside the scripts that submit, claim and end a job (api_scripts, worker_scripts) and in the
API's periodic dispatch, which catches slots that free without a job's end (a worker that starts).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from chatq.core import keys
from chatq.core.lua import LuaFunction, Script
from chatq.core.queue import BATCH_LANE

OUTPUT_WEIGHT = 2  # an output token's service against a prompt token's


@dataclass(frozen=True)
class Share:
    """What a job counts for in its owner's fair share: the service it is charged as it is dispatched (its prompts,
    and OUTPUT_WEIGHT times the output it may make), and its owner's weight."""

    cost: float
    weight: float = 1.0

    @classmethod
    def of(cls, prompts: list[list[int]], reserved: int, weight: float) -> Share:
        """`reserved`: the prompts' tokens and the most output (chatq.api.limits.reserved_tokens)."""
        prompt = sum(map(len, prompts))
        return cls(prompt + OUTPUT_WEIGHT * (reserved - prompt), weight)


# The owner's service goes up by `amount` (down, for a job that used less than it was charged), and its place in
# every lane it waits in with it.
FAIR_CHARGE = LuaFunction("""
local function fair_charge(service, waiting_prefix, lanes, owner, amount)
  local total = redis.call('HINCRBYFLOAT', service, owner, amount)
  for lane = 0, lanes - 1 do
    redis.call('ZADD', waiting_prefix .. lane, 'XX', total, owner)
  end
end
""")

# A job that ended set right in its owner's service: charged its estimate (`cost`, divided by `weight`, in its
# record) when dispatched, it is charged what it used instead.
FAIR_SETTLE = LuaFunction(
    """
local function fair_settle(service, waiting_prefix, lanes, job, input_tokens, output_tokens)
  local h = redis.call('HMGET', job, 'cost', 'weight', 'owner')
  if not h[1] then return end
  local used = tonumber(input_tokens) + OUTPUT_WEIGHT * tonumber(output_tokens)
  fair_charge(service, waiting_prefix, lanes, h[3] or '', (used - tonumber(h[1])) / (tonumber(h[2]) or 1))
end
""".replace("OUTPUT_WEIGHT", str(OUTPUT_WEIGHT)),
    uses=(FAIR_CHARGE,),
)

# A job parked at the end of its owner's list in a lane; an owner that was not waiting there starts no earlier than
# the virtual time (`clock`: the start of the job dispatched last).
FAIR_PARK = LuaFunction("""
local function fair_park(waiting, parked, service, clock, owner, job_id)
  redis.call('RPUSH', parked, job_id)
  if redis.call('ZSCORE', waiting, owner) then return end
  local own = tonumber(redis.call('HGET', service, owner) or '0')
  local now = tonumber(redis.call('GET', clock) or '0')
  if now > own then
    own = now
    redis.call('HSET', service, owner, tostring(own))
  end
  redis.call('ZADD', waiting, own, owner)
end
""")

# Free slots of the model's live workers: their slots, less the jobs running and those dispatched but not yet
# claimed (one that ended or was cancelled before any worker claimed it holds none, and leaves the set).
FAIR_FREE = LuaFunction("""
local function fair_free(n)
  local slots = 0
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', n.workers, n.now - n.ttl, '+inf')) do
    slots = slots + (tonumber(redis.call('HGET', n.worker_prefix .. w, 'slots')) or 0)
  end
  for _, id in ipairs(redis.call('SMEMBERS', n.dispatched)) do
    if redis.call('HGET', n.job_prefix .. id, 'status') ~= 'queued' then redis.call('SREM', n.dispatched, id) end
  end
  return slots - redis.call('SCARD', n.running) - redis.call('SCARD', n.dispatched)
end
""")

# Dispatches parked jobs while the model's workers have free slots: from the first lane with any, the least served
# owner's oldest job; a job no longer queued (cancelled while parked) is dropped. How many went.
FAIR_DISPATCH = LuaFunction(
    """
local function fair_dispatch(n)
  local free, sent, lane = fair_free(n), 0, 0
  while free > 0 and lane < n.lanes do
    local owner = redis.call('ZRANGE', n.waiting_prefix .. lane, 0, 0)[1]
    if not owner then
      lane = lane + 1
    else
      local parked = n.parked_prefix .. lane .. ':' .. owner
      local id = redis.call('LPOP', parked)
      if redis.call('LLEN', parked) == 0 then redis.call('ZREM', n.waiting_prefix .. lane, owner) end
      local job = n.job_prefix .. (id or '')
      local h = redis.call('HMGET', job, 'status', 'task_queue', 'task', 'cost', 'weight')
      if id and h[1] == 'queued' and h[2] and h[3] then
        redis.call('LPUSH', h[2], h[3])
        redis.call('HSET', job, 'queued_at', n.now)
        redis.call('HDEL', job, 'parked')
        redis.call('SADD', n.dispatched, id)
        redis.call('SET', n.clock, redis.call('HGET', n.service, owner) or '0')
        fair_charge(n.service, n.waiting_prefix, n.lanes, owner, (tonumber(h[4]) or 0) / (tonumber(h[5]) or 1))
        free, sent = free - 1, sent + 1
      end
    end
  end
  return sent
end
""",
    uses=(FAIR_FREE, FAIR_CHARGE),
)

# The call of fair_dispatch in a script, with the names of the model's dispatch the script declares (dispatch_keys,
# and `lanes`, `now`, `worker_ttl`); its value is how many jobs went.
DISPATCH_CALL = """fair_dispatch({
  running = running, dispatched = dispatched, workers = workers, service = service, clock = clock,
  worker_prefix = worker_prefix, waiting_prefix = waiting_prefix, parked_prefix = parked_prefix,
  job_prefix = job_prefix, lanes = tonumber(lanes), now = tonumber(now), ttl = tonumber(worker_ttl),
})"""

# The API's periodic dispatch of one model.
_DISPATCH = Script(
    keys=("running", "dispatched", "workers", "service", "clock"),
    args=("worker_prefix", "waiting_prefix", "parked_prefix", "job_prefix", "lanes", "now", "worker_ttl"),
    uses=(FAIR_DISPATCH,),
    body="return " + DISPATCH_CALL,
)


def dispatch_keys(model: str) -> dict[str, str]:
    """The keys and name prefixes of the model's dispatch, as every script that dispatches declares them."""
    return {
        "running": keys.running(model),
        "dispatched": keys.dispatched(model),
        "workers": keys.workers(model),
        "service": keys.fair_service(model),
        "clock": keys.fair_clock(model),
        "worker_prefix": keys.worker(""),
        "waiting_prefix": keys.fair_waiting(model, ""),
        # Completed with `{lane}:{owner}` in Lua.
        "parked_prefix": keys.fair_parked(model, "", "").removesuffix(":"),
        "job_prefix": keys.job(""),
    }


async def dispatch(client: aioredis.Redis, model: str, now: float, worker_ttl: float) -> int:
    """Dispatches the model's parked jobs into its workers' free slots; how many went."""
    sent = await _DISPATCH.run(client, **dispatch_keys(model), lanes=BATCH_LANE, now=now, worker_ttl=worker_ttl)
    return int(sent)
