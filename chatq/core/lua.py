"""Lua scripts declared once each, with named keys and arguments, and the Lua functions they share.

Every atomic job transition is one such script, beside its one typed caller: the API's (api_scripts: submit,
cancel), the holding worker's (worker_scripts: claim, publish_events, update_record), and those of a job whose
worker or task message was lost (reclaim_scripts: reclaim, redeliver). The API's submit creates a record queued; its
status then changes once per transition: queued -> in_progress (a worker's claim), queued -> cancelled (the API),
in_progress -> completed | failed | cancelled (the holding worker).

Each script is a Script: it names its keys and arguments, its body reads them by those names, and its caller passes
them by name. Scripts go by EVALSHA; the worker's step scripts go by EVAL in its pipeline, as redis-py would send
SCRIPT EXISTS before every execute: a second round trip per step.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.client import Pipeline

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
    reads only its own arguments; `uses`: the shared functions it calls, which come before it."""

    source: str
    uses: tuple[LuaFunction, ...] = ()
    name: str = field(init=False)

    def __post_init__(self) -> None:
        head = re.match(r"\s*local function ([A-Za-z_]\w*)\(", self.source)
        if head is None:
            raise ValueError("a shared Lua function starts with `local function <name>(`")
        if _reads_keys_or_argv(self.source):
            raise ValueError(f"Lua function {head[1]} reads KEYS or ARGV: it takes what it needs as arguments")
        object.__setattr__(self, "name", head[1])
        uncalled = [f.name for f in self.uses if f.name not in _code_words(self.source)]
        if uncalled:
            raise ValueError(f"Lua function {head[1]} uses {uncalled} but never calls them")

    def with_uses(self) -> list[LuaFunction]:
        """It and what it calls, each after what it calls."""
        out: list[LuaFunction] = []
        for f in self.uses:
            out += [g for g in f.with_uses() if g not in out]
        return [*out, self]


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
        functions: list[LuaFunction] = []
        for f in self.uses:
            functions += [g for g in f.with_uses() if g not in functions]
        parts = [f.source.strip() for f in functions] + [line for line in prelude if line] + [self.body.strip()]
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


def flat(fields: Mapping[str, str | bytes | int]) -> list[str | bytes | int]:
    """Field/value pairs in one list, as a script's tail takes a record's fields."""
    return [x for pair in fields.items() for x in pair]


# Lengthens a key's expiry to at least `ttl` seconds: a key without one gets it; a missing key stays missing.
EXTEND = LuaFunction("""
local function extend(key, ttl)
  if redis.call('TTL', key) < tonumber(ttl) then redis.call('EXPIRE', key, ttl) end
end
""")

# Pushes a background job's webhook messages (webhooks.WebhookMessages.block, "" for none) onto the webhook queue,
# in the script that ends the job, so no end is lost between it and its webhook. The job's kind and its status
# complete each message; a job whose request is not a background one sends none. A response whose text ran out of
# tokens ended `incomplete`, as its Response says (response_object.status_of). The queue is named in the block,
# not in KEYS, which Redis Cluster forbids (as the cancel script's completed prefixes).
PUSH_WEBHOOKS = LuaFunction("""
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


# Seconds since the epoch by Redis' clock, which every process shares.
SERVER_NOW = LuaFunction(
    """
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""
)
