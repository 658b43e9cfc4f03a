"""The LoRA adapters every API and worker knows: one Redis hash, by name, each a load of an adapter's files
(chatq.core.lora_format checks them)."""

from __future__ import annotations

import time
import uuid

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel

from chatq.core import keys
from chatq.core.errors import NotFound
from chatq.core.lora_format import LoraConfig


class Adapter(BaseModel):
    """A known adapter, as the hash keys.adapters() holds it. `id` names this load of it: a worker's copy, and its
    share of the prefix cache, are of one load, so a name loaded again from other files starts afresh."""

    name: str
    base: str
    path: str
    rank: int
    id: str
    created: int


class AdapterNotFound(NotFound):
    def __init__(self, name: str):
        super().__init__(f"The lora adapter '{name}' cannot be found.", "lora_name")


def parse_modules(value: str) -> dict[str, str]:
    """CHATQ_LORA_MODULES, vLLM's `name=path` pairs separated by commas (or spaces), by name."""
    pairs = {}
    for item in value.replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"CHATQ_LORA_MODULES: {item!r} is not name=path")
        pairs[name] = path
    return pairs


def record(name: str, base: str, path: str, config: LoraConfig) -> Adapter:
    """A new load of an adapter."""
    return Adapter(name=name, base=base, path=path, rank=config.rank, id=uuid.uuid4().hex, created=int(time.time()))


async def add(client: aioredis.Redis, adapter: Adapter, replace: bool) -> bool:
    """Makes the adapter known; False if its name is taken and not `replace`."""
    value = adapter.model_dump_json()
    if replace:
        await client.hset(keys.adapters(), adapter.name, value)  # type: ignore[misc]
        return True
    return bool(await client.hsetnx(keys.adapters(), adapter.name, value))  # type: ignore[misc]


def add_at_start(client: redis.Redis, adapter: Adapter) -> None:
    """A worker's CHATQ_LORA_MODULES entry: a load already known from the same path keeps its id (and cache)."""
    known = client.hget(keys.adapters(), adapter.name)
    if known is not None and Adapter.model_validate_json(known).path == adapter.path:  # type: ignore[arg-type]
        return
    client.hset(keys.adapters(), adapter.name, adapter.model_dump_json())


async def remove(client: aioredis.Redis, name: str) -> None:
    if not await client.hdel(keys.adapters(), name):  # type: ignore[misc]
        raise AdapterNotFound(name)


async def read_all(client: aioredis.Redis) -> dict[str, Adapter]:
    stored: dict[str, str] = await client.hgetall(keys.adapters())  # type: ignore[misc,assignment]
    return {name: Adapter.model_validate_json(value) for name, value in stored.items()}
