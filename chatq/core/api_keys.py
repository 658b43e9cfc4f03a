"""Managed API keys: created, limited and revoked at run time, kept in Redis by the hash of their secret.

A key's record is one JSON string under keys.api_key(hash), where an API finds it from the key a request sends; the
hash keys.api_key_names() maps each key's name to its hash, so names are unique and listing needs no scan. The admin
routes (chatq.api.admin) are the one writer. Redis never holds a key itself: the secret is shown once, at creation.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis

from chatq.core import keys
from chatq.core.lua import Script

SECRET_PREFIX = "sk-chatq-"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def key_hash(key: str) -> str:
    """What a key is known by in Redis and in the records of what it creates (their `owner`)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def redacted(secret: str) -> str:
    """How a listing shows a key, as OpenAI's do: enough to tell keys apart, never enough to use one."""
    return f"{secret[: len(SECRET_PREFIX) + 2]}...{secret[-4:]}"


@dataclass(frozen=True)
class Limits:
    """What a key may use: None is no limit."""

    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute: prompt plus max_tokens, reserved as a request is accepted
    in_flight: int | None = None  # jobs queued or running at once
    batch_tokens: int | None = None  # input tokens its batches may hold enqueued at once, per model
    weight: float = 1.0  # its share of each model's workers against other keys' (chatq.core.fair)
    models: tuple[str, ...] = ()  # the models it may use; empty: every model


@dataclass(frozen=True)
class ApiKey:
    name: str
    hash: str
    redacted: str
    created_at: int
    expires_at: int | None = None
    limits: Limits = field(default_factory=Limits)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> ApiKey:
        data = json.loads(raw)
        limits = data.pop("limits", {})
        limits["models"] = tuple(limits.get("models") or ())
        return cls(**data, limits=Limits(**limits))

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def allows(self, model: str) -> bool:
        return not self.limits.models or model in self.limits.models

    def view(self) -> dict[str, Any]:
        """What the admin routes show of it."""
        return {
            "object": "api_key",
            "name": self.name,
            "redacted_value": self.redacted,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            **asdict(self.limits),
        }


# The key's name is taken for its hash, and its record written; 0 if the name was taken already.
_CREATE = Script(
    keys=("names", "record"),
    args=("name", "hash", "record_json"),
    body="""
if redis.call('HSETNX', names, name, hash) == 0 then
  return 0
end
redis.call('SET', record, record_json)
return 1
""",
)

# The record of the key `name` while its name still maps to `hash`; 0 once revoked.
_UPDATE = Script(
    keys=("names", "record"),
    args=("name", "hash", "record_json"),
    body="""
if redis.call('HGET', names, name) ~= hash then
  return 0
end
redis.call('SET', record, record_json)
return 1
""",
)

# The key's name and record go together; 0 if its name maps to it no more.
_REVOKE = Script(
    keys=("names", "record"),
    args=("name", "hash"),
    body="""
if redis.call('HGET', names, name) ~= hash then
  return 0
end
redis.call('HDEL', names, name)
redis.call('DEL', record)
return 1
""",
)


async def create(client: aioredis.Redis, key: ApiKey) -> bool:
    """Stores a new key; False if another key has its name."""
    done = await _CREATE.run(
        client,
        names=keys.api_key_names(),
        record=keys.api_key(key.hash),
        name=key.name,
        hash=key.hash,
        record_json=key.to_json(),
    )
    return bool(done)


async def by_hash(client: aioredis.Redis, hashed: str) -> ApiKey | None:
    raw: str | None = await client.get(keys.api_key(hashed))  # type: ignore[assignment]
    return None if raw is None else ApiKey.from_json(raw)


async def by_name(client: aioredis.Redis, name: str) -> ApiKey | None:
    hashed: str | None = await client.hget(keys.api_key_names(), name)  # type: ignore[assignment,misc]
    return None if hashed is None else await by_hash(client, hashed)


async def listing(client: aioredis.Redis) -> list[ApiKey]:
    """Every key, by name."""
    hashes: dict[str, str] = await client.hgetall(keys.api_key_names())  # type: ignore[assignment,misc]
    pipe = client.pipeline(transaction=False)
    for name in sorted(hashes):
        pipe.get(keys.api_key(hashes[name]))
    return [ApiKey.from_json(raw) for raw in await pipe.execute() if raw is not None]


async def update(client: aioredis.Redis, key: ApiKey, **changes: Any) -> ApiKey | None:
    """The key with `changes` (Limits' fields, `expires_at`) stored; None if it was revoked meanwhile."""
    expires_at = changes.pop("expires_at", key.expires_at)
    new = replace(key, expires_at=expires_at, limits=replace(key.limits, **changes))
    done = await _UPDATE.run(
        client,
        names=keys.api_key_names(),
        record=keys.api_key(key.hash),
        name=key.name,
        hash=key.hash,
        record_json=new.to_json(),
    )
    return new if done else None


async def revoke(client: aioredis.Redis, key: ApiKey) -> bool:
    done = await _REVOKE.run(
        client, names=keys.api_key_names(), record=keys.api_key(key.hash), name=key.name, hash=key.hash
    )
    return bool(done)
