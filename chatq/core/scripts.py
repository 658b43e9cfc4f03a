"""Every atomic job transition, a Lua script each, beside its one typed caller.

The API's submit creates a record queued; its status then changes once per transition: queued -> in_progress (a
worker's claim), queued -> cancelled (the API), in_progress -> completed | failed | cancelled (the holding worker).

Each script is a Script: it names its keys and arguments, its body reads them by those names, and its caller passes
them by name. Scripts go by EVALSHA; the worker's step scripts go by EVAL in its pipeline, as redis-py would send
SCRIPT EXISTS before every execute: a second round trip per step.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from redis.client import Pipeline

from chatq.core import keys
from chatq.core.job import Event
from chatq.core.queue import task_fields

# Lua's reserved words and the globals the scripts call: a key or argument named so would hide what a body means.
# fmt: off
_LUA_WORDS = frozenset({
    "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if", "in", "local", "nil",
    "not", "or", "repeat", "return", "then", "true", "until", "while",
    "KEYS", "ARGV", "redis", "cjson", "cmsgpack", "bit", "struct", "table", "string", "math", "os", "type", "next",
    "unpack", "tonumber", "tostring", "ipairs", "pairs", "pcall", "error", "assert", "select", "rawget", "rawset",
    "rawequal", "setmetatable", "getmetatable", "_G", "_VERSION",
})
# fmt: on
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A Lua string or comment, whichever starts first: the words inside are not code.
_STRING_OR_COMMENT = re.compile(r"""'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*"|--[^\n]*""")


def _code_words(lua: str) -> set[str]:
    return set(_NAME.findall(_STRING_OR_COMMENT.sub(" ", lua)))


def _reads_keys_or_argv(lua: str) -> bool:
    return re.search(r"\b(KEYS|ARGV)\b", lua) is not None


@dataclass(frozen=True)
class LuaFunction:
    """A Lua function scripts share (`local function name(...)`). It comes before a script's names are bound, so it
    reads only its own arguments."""

    source: str
    name: str = field(init=False)

    def __post_init__(self) -> None:
        head = re.match(r"\s*local function ([A-Za-z_]\w*)\(", self.source)
        if head is None:
            raise ValueError("a shared Lua function starts with `local function <name>(`")
        if _reads_keys_or_argv(self.source):
            raise ValueError(f"Lua function {head[1]} reads KEYS or ARGV: it takes what it needs as arguments")
        object.__setattr__(self, "name", head[1])


@dataclass(frozen=True)
class Script:
    """A Lua script whose keys and arguments have names: Lua locals its body reads (bound from KEYS and ARGV by a
    prelude made from this declaration, the body never indexes them), and the keywords its caller passes them by, in
    any order. A key tail or an argument tail is a Lua table of that name holding what follows the named keys or
    arguments; the caller passes it as a sequence under that name. A script that breaks these rules cannot be made:
    a body reading KEYS or ARGV, a name left unused, two alike, one that is no Lua name or hides a Lua word."""

    keys: tuple[str, ...]
    args: tuple[str, ...]
    body: str
    key_tail: str | None = None
    tail: str | None = None
    uses: tuple[LuaFunction, ...] = ()  # the shared functions the body calls
    source: str = field(init=False, repr=False)  # what Redis runs: the shared functions, the prelude, the body
    _declared: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if problems := self._problems():
            raise ValueError("; ".join(problems))
        prelude = [_bind(self.keys, "KEYS"), _bind(self.args, "ARGV")]
        if self.key_tail is not None:
            prelude.append(_rest(self.key_tail, "KEYS", len(self.keys)))
        if self.tail is not None:
            prelude.append(_rest(self.tail, "ARGV", len(self.args)))
        parts = [f.source.strip() for f in self.uses] + [line for line in prelude if line] + [self.body.strip()]
        object.__setattr__(self, "source", "\n".join(parts) + "\n")
        object.__setattr__(self, "_declared", frozenset(self.names))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the caller passes: the keys, the key tail, the arguments, the tail."""
        tails = (self.key_tail, self.tail)
        return (*self.keys, *self.args, *(t for t in tails if t is not None))

    def _problems(self) -> list[str]:
        names, functions = self.names, [f.name for f in self.uses]
        problems = [f"{n!r} is not a Lua name" for n in names if _NAME.fullmatch(n) is None]
        problems += [f"{n!r} hides a Lua word" for n in names if n in _LUA_WORDS]
        declared = [*names, *functions]
        problems += [f"{n!r} is named twice" for n in sorted({n for n in declared if declared.count(n) > 1})]
        if _reads_keys_or_argv(self.body):
            problems.append("the body reads KEYS or ARGV: it reads the declared names")
        used = _code_words(self.body)
        problems += [f"{n!r} is declared but the body never reads it" for n in names if n not in used]
        problems += [f"Lua function {n} is in `uses` but the body never calls it" for n in functions if n not in used]
        return problems

    def run(self, client: redis.Redis | aioredis.Redis, /, **named: Any) -> Any:
        """Runs the script by EVALSHA (loaded first where Redis lacks it): its reply, awaitable for an asyncio
        client. A name missing or not declared is a TypeError, before anything is sent."""
        script_keys, args = self._order(named)
        return client.register_script(self.source)(keys=script_keys, args=args)

    def run_in(self, pipe: Pipeline, /, **named: Any) -> None:
        """Queues the script into `pipe` by EVAL, as a Script object would have the pipeline ask SCRIPT EXISTS first."""
        script_keys, args = self._order(named)
        pipe.eval(self.source, len(script_keys), *script_keys, *args)

    def _order(self, named: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
        """The keys and the arguments in their declared order, each tail after its named part."""
        if named.keys() != self._declared:
            missing, unexpected = sorted(self._declared - named.keys()), sorted(named.keys() - self._declared)
            raise TypeError(f"Lua script called without {missing}, with undeclared {unexpected}")
        script_keys, args = [named[k] for k in self.keys], [named[a] for a in self.args]
        if self.key_tail is not None:
            script_keys += named[self.key_tail]
        if self.tail is not None:
            args += named[self.tail]
        return script_keys, args


def _bind(names: Sequence[str], table: str) -> str:
    """`local a, b = KEYS[1], KEYS[2]`, or nothing for no names."""
    if not names:
        return ""
    return f"local {', '.join(names)} = {', '.join(f'{table}[{i}]' for i in range(1, len(names) + 1))}"


def _rest(name: str, table: str, after: int) -> str:
    """A Lua table `name` of what follows the first `after` entries of KEYS or ARGV, copied one by one: unpack's
    stack limit would cap the events of one step."""
    return f"local {name} = {{}}\nfor i = {after + 1}, #{table} do {name}[#{name} + 1] = {table}[i] end"


# Lengthens a key's expiry to at least `ttl` seconds: a key without one gets it; a missing key stays missing.
_EXTEND = LuaFunction("""
local function extend(key, ttl)
  if redis.call('TTL', key) < tonumber(ttl) then redis.call('EXPIRE', key, ttl) end
end
""")

# Pushes a background job's webhook messages (webhooks.WebhookMessages.block, "" for none) onto the webhook queue,
# in the script that ends the job, so no end is lost between it and its webhook. The job's kind and its status
# complete each message; a job whose request is not a background one sends none. A response whose text ran out of
# tokens ended `incomplete`, as its Response says (response_object.status_of). The queue is named in the block,
# not in KEYS, which Redis Cluster forbids (as the cancel script's completed prefixes).
_PUSH_WEBHOOKS = LuaFunction("""
local function push_webhooks(block, job, status)
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
""")

# An event's envelope, as chatq.core.job.Event.to_json writes it: the one place Lua writes one. `data` is JSON text.
_ENVELOPE = LuaFunction("""
local function envelope(seq, kind, data)
  return '{"seq":' .. seq .. ',"event":"' .. kind .. '","data":' .. data .. '}'
end
""")

# Returns {"queued", rank}, {"existing", id}, {"full"} or {"taken"}. The idempotent job's record key is completed
# from the idempotency key's value, which Redis Cluster forbids (as the cancel script does).
_SUBMIT = Script(
    keys=(
        "job",
        "queued",
        "task_queue",  # the Celery queue's list
        "idem",  # the idempotency key; the record's key when the request has none
        "owner_jobs",  # the owner's list of jobs; the record's key when the job is not listed
    ),
    args=(
        "job_id",
        "score",
        "task",  # the Celery task message
        "max_queued",  # the cap on queued jobs; 0: none
        "job_prefix",  # keys.job("")
        "has_idem",  # "1" when the request has an idempotency key
        "listed",  # "1" when the job is listed
        "keep",  # how many of the owner's newest jobs the list keeps
        "list_ttl",
        "now",
    ),
    tail="fields",  # the record's field/value pairs
    uses=(_EXTEND,),
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
if cap > 0 and redis.call('ZCARD', queued) >= cap then return {'full'} end
redis.call('HSET', job, 'id', job_id, unpack(fields))
redis.call('ZADD', queued, score, job_id)
redis.call('LPUSH', task_queue, task)
if has_idem == '1' then redis.call('SET', idem, job_id) end
if listed == '1' then
  redis.call('ZADD', owner_jobs, now, job_id)
  redis.call('ZREMRANGEBYRANK', owner_jobs, 0, -1 - tonumber(keep))
  extend(owner_jobs, list_ttl)
end
return {'queued', redis.call('ZRANK', queued, job_id)}
""",
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
) -> Submitted:
    """Records the job and pushes its Celery task message in one step, so no job exists that no worker will get.

    In the same step: a job the idempotency key already names is answered instead, a queue holding `max_queued`
    waiting jobs refuses it (so many APIs together never overshoot), and a taken id is refused (a repeated
    request_id never overwrites a job). `idem` is the idempotency key's Redis key (keys.idempotency); it is the
    record's `idem` field too, set with no expiry: the job's end expires it. With a `listing`, the job joins its
    owner's list (named in the record's `index`), whose oldest jobs past `listing.keep` leave it.
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
        job_id=job_id,
        score=score,
        task=message,
        max_queued=max_queued,
        job_prefix=keys.job(""),
        has_idem="1" if idem else "0",
        listed="1" if listing else "0",
        keep=listing.keep if listing else 0,
        list_ttl=listing.ttl if listing else 0,
        now=time.time() if listing else 0,
        fields=_flat(fields),
    )
    outcome = Outcome(reply[0])
    if outcome is Outcome.existing:
        return Submitted(outcome, reply[1])
    return Submitted(outcome, job_id, reply[1] if outcome is Outcome.queued else None)


_CLAIM = Script(
    keys=(
        "job",
        "queued",
        "cancels",  # the claiming worker's cancel set
        "running",  # the model's running set
    ),
    args=(
        "worker",
        "now",
        "job_id",
        "lane",  # the priority lane the task came in
        "delivery",  # the task's kombu delivery tag
    ),
    body="""
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
        worker=worker,
        now=time.time(),
        job_id=job_id,
        lane=lane,
        delivery=delivery,
    )
    return dict(zip(record[::2], record[1::2], strict=True))


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
    uses=(_EXTEND, _PUSH_WEBHOOKS, _ENVELOPE),
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
    # When the task counts as sent, for the sweep that sends a lost one again (scripts.redeliver); a stopping
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
        fields=_flat(task_fields(how.queue, how.message, how.queued_at or time.time())),
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
local h = redis.call('HMGET', job, 'status', 'tag', 'queued_at', 'task')
if h[1] ~= 'queued' or h[2] ~= tag or not h[4] then return 0 end
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
    uses=(_EXTEND, _PUSH_WEBHOOKS),
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
    ),
    args=(
        "worker",  # the writing worker
        "job_id",
        "ttl",  # seconds
        "last",  # "1" for the job's last write, "0" for progress
        "webhooks",  # the webhook block, which the last write sends once
        "increments",  # the last write's additions to the metrics hash: a JSON object of field -> amount (a string)
    ),
    tail="fields",  # the record's field/value pairs
    uses=(_EXTEND, _PUSH_WEBHOOKS),
    body="""
redis.call('EXPIRE', events, ttl)
local h = redis.call('HMGET', job, 'status', 'worker', 'deleted', 'idem', 'index')
if not h[1] or h[1] == 'queued' or (h[2] and h[2] ~= worker) then return 0 end
if last == '1' then
  redis.call('SREM', running, job_id)
  -- Counted once: a last write sent again (its reply lost) finds the job ended.
  if h[1] == 'in_progress' then
    for name, amount in pairs(cjson.decode(increments)) do redis.call('HINCRBYFLOAT', metrics, name, amount) end
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
) -> None:
    """Writes the worker's fields into the job's record; the last write starts its expiry, takes the job off the
    model's running set, adds `metrics` (field -> amount) to the model's metrics hash (chatq.core.metrics) and, for a
    background job, pushes its `webhook` messages (chatq.core.webhooks.WebhookMessages.block).

    The log's expiry is refreshed first, so the log of a job whose worker vanished still expires. A record deleted
    meanwhile stays gone rather than come back holding only these fields; one hidden by DELETE is removed with its
    log at the last write. A job another worker took over is left to it, and counted by it.
    """
    # Each amount as Python writes it, for HINCRBYFLOAT to read as written: a number cjson decoded would reach Redis
    # rounded differently.
    increments = {name: repr(float(amount)) for name, amount in (metrics or {}).items()}
    _UPDATE_RECORD.run_in(
        pipe,
        job=keys.job(job_id),
        events=keys.events(job_id),
        running=keys.running(model),
        metrics=keys.metrics(model),
        worker=worker,
        job_id=job_id,
        ttl=ttl,
        last=int(last),
        webhooks=webhook,
        increments=orjson.dumps(increments),
        fields=_flat(fields),
    )


def _flat(fields: Mapping[str, str | bytes | int]) -> list[str | bytes | int]:
    return [x for pair in fields.items() for x in pair]
