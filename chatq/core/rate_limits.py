"""A managed key's requests and tokens per minute: two buckets per key in Redis, refilled continuously.

Each bucket holds up to its limit and refills at limit/60 a second, so a key may spend a minute's allowance at once
and then one request's worth as it comes back: no window edge lets a burst through twice. A request takes one
request and its tokens (prompt plus max_tokens) from both at once or from neither, in one script across every API
replica; the API gives back what a request did not use (its tokens, when it was refused further on). A bucket left
untouched for a minute is full, so it expires then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from chatq.core import keys
from chatq.core.lua import SERVER_NOW, LuaFunction, Script

WINDOW = 60.0  # seconds a bucket takes to refill from empty: the limits are per minute


_LEVEL = LuaFunction(
    """
local function level(bucket, limit, now)
  local held = redis.call('HMGET', bucket, 'level', 'at')
  if not held[1] then
    return limit
  end
  return math.min(limit, tonumber(held[1]) + (now - tonumber(held[2])) * limit / 60)
end
"""
)

_SET = LuaFunction(
    """
local function set_level(bucket, value, now)
  redis.call('HSET', bucket, 'level', tostring(value), 'at', tostring(now))
  redis.call('EXPIRE', bucket, 61)
end
"""
)

# One request and `tokens` taken from the key's buckets if both hold enough (a limit of 0 is none); the levels
# before taking, and 1 if taken. Levels go back as strings: Redis would truncate a Lua number.
_TAKE = Script(
    keys=("requests", "tokens_bucket"),
    args=("rpm", "tpm", "tokens"),
    uses=(SERVER_NOW, _LEVEL, _SET),
    body="""
local now = server_now()
local rpm, tpm, wanted = tonumber(rpm), tonumber(tpm), tonumber(tokens)
local r = rpm > 0 and level(requests, rpm, now) or 0
local t = tpm > 0 and level(tokens_bucket, tpm, now) or 0
if (rpm > 0 and r < 1) or (tpm > 0 and t < wanted) then
  return {0, tostring(r), tostring(t)}
end
if rpm > 0 then set_level(requests, r - 1, now) end
if tpm > 0 then set_level(tokens_bucket, t - wanted, now) end
return {1, tostring(r), tostring(t)}
""",
)

# What a request took and did not use, back into the buckets (never past their limits).
_GIVE = Script(
    keys=("requests", "tokens_bucket"),
    args=("rpm", "tpm", "request", "tokens"),
    uses=(SERVER_NOW, _LEVEL, _SET),
    body="""
local now = server_now()
local rpm, tpm = tonumber(rpm), tonumber(tpm)
if rpm > 0 and tonumber(request) > 0 then
  set_level(requests, math.min(rpm, level(requests, rpm, now) + tonumber(request)), now)
end
if tpm > 0 and tonumber(tokens) > 0 then
  set_level(tokens_bucket, math.min(tpm, level(tokens_bucket, tpm, now) + tonumber(tokens)), now)
end
return 1
""",
)


def duration(seconds: float) -> str:
    """A wait as OpenAI's headers write one: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass(frozen=True)
class Verdict:
    """One request against its key's limits: whether it was taken, and what the x-ratelimit-* headers say."""

    taken: bool
    rpm: int | None
    tpm: int | None
    requests_left: float  # in the bucket after this request (before it, if refused)
    tokens_left: float
    tokens: int  # what the request asked for

    @property
    def refused_on(self) -> Literal["requests", "tokens"] | None:
        if self.taken:
            return None
        return "requests" if self.rpm and self.requests_left < 1 else "tokens"

    def wait(self) -> float:
        """Seconds until the refused request would fit."""
        if self.refused_on == "requests":
            assert self.rpm
            return (1 - self.requests_left) * WINDOW / self.rpm
        assert self.tpm
        return (self.tokens - self.tokens_left) * WINDOW / self.tpm

    def headers(self) -> dict[str, str]:
        out = {}
        for name, limit, left in (("requests", self.rpm, self.requests_left), ("tokens", self.tpm, self.tokens_left)):
            if limit:
                out[f"x-ratelimit-limit-{name}"] = str(limit)
                out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(left)))
                out[f"x-ratelimit-reset-{name}"] = duration((limit - left) * WINDOW / limit)
        return out


async def take(client: aioredis.Redis, owner: str, rpm: int | None, tpm: int | None, tokens: int) -> Verdict:
    """One request of `tokens` tokens from the buckets of the key `owner`."""
    taken, r, t = await _TAKE.run(
        client,
        requests=keys.rate_bucket(owner, "requests"),
        tokens_bucket=keys.rate_bucket(owner, "tokens"),
        rpm=rpm or 0,
        tpm=tpm or 0,
        tokens=tokens,
    )
    requests_left, tokens_left = float(r), float(t)
    if taken:
        requests_left, tokens_left = requests_left - (1 if rpm else 0), tokens_left - (tokens if tpm else 0)
    return Verdict(bool(taken), rpm, tpm, requests_left, tokens_left, tokens)


async def give_back(
    client: aioredis.Redis, owner: str, rpm: int | None, tpm: int | None, request: bool, tokens: int
) -> None:
    await _GIVE.run(
        client,
        requests=keys.rate_bucket(owner, "requests"),
        tokens_bucket=keys.rate_bucket(owner, "tokens"),
        rpm=rpm or 0,
        tpm=tpm or 0,
        request=int(request),
        tokens=tokens,
    )
