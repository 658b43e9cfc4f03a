"""The models this API serves: every model a worker registered in Redis (chatq.core.registry), live while one of its
workers is. The registry is read again at most every REFRESH seconds, so a worker started after the API is served
without a restart; each model's tokenizer and templates are loaded once per entry."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import redis.asyncio as aioredis

from chatq.api.admission import ServedModel
from chatq.core import adapters, keys, registry
from chatq.core.adapters import Adapter
from chatq.core.api_keys import ApiKey
from chatq.core.errors import ModelNotFound, NoLiveWorker, RedisUnreachable
from chatq.core.settings import Settings

T = TypeVar("T")
REFRESH = 1.0  # seconds a reading of the registry serves requests
# A request for a model the last reading lacks reads again, a worker may just have come, but no sooner than this after
# the last reading: a flood of requests for an unknown model costs Redis little.
MISS_REFRESH = 0.1


class Models:
    def __init__(self, client: aioredis.Redis, settings: Settings):
        self.redis = client
        self.settings = settings
        self.served: dict[str, ServedModel] = {}
        self.workers: dict[str, int] = {}  # live workers per registered model
        self.adapters: dict[str, Adapter] = {}  # the known LoRA adapters, by name
        self.read_at = -float("inf")
        self._reading: asyncio.Future[None] | None = None
        # Rendering and tokenizing run in threads, so a long prompt costs its own request time, not the event
        # loop's; bounded, so many at once queue here rather than take every core.
        self.limiter = anyio.CapacityLimiter(settings.render_threads)

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in one of the render threads."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def get(self, name: str | None, need_worker: bool = False, key: ApiKey | None = None) -> ServedModel:
        """The model a request names (none: CHATQ_MODEL_NAME), or the model serving the LoRA adapter it names.
        `need_worker`: the request waits for its answer, so a model without a live worker is a 503 rather than a
        job left waiting. `key`: the managed key asking, to which a model it may not use is not found."""
        name = name or self.settings.model_name
        if key is not None and not key.allows(name):
            raise ModelNotFound(name)
        await self._fresh(REFRESH)
        if self._base(name) not in self.served or (need_worker and not self.workers.get(self._base(name))):
            await self._fresh(MISS_REFRESH)
        base = self._base(name)
        if base not in self.served:
            raise ModelNotFound(name)
        if need_worker and not self.workers.get(base):
            raise NoLiveWorker(base, retry_after=max(1, self.settings.worker_ttl // 3))
        if name in self.adapters:
            return dataclasses.replace(self.served[base], adapter=self.adapters[name])
        return self.served[base]

    def _base(self, name: str) -> str:
        """The model a name serves with: an adapter's base model, or the model of that name."""
        adapter = self.adapters.get(name)
        return adapter.base if adapter is not None and name not in self.served else name

    async def live(self) -> list[tuple[ServedModel, int]]:
        """The models with a live worker, and how many each has, by name."""
        await self._fresh(MISS_REFRESH)
        return [(self.served[n], w) for n, w in sorted(self.workers.items()) if w and n in self.served]

    async def _fresh(self, max_age: float) -> None:
        """Reads the registry if the last reading is older than `max_age`; concurrent callers share one reading."""
        if time.monotonic() - self.read_at <= max_age:
            return
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
            self._reading.add_done_callback(self._read_done)
        await asyncio.shield(self._reading)

    def _read_done(self, reading: asyncio.Future[None]) -> None:
        self._reading = None
        if not reading.cancelled():
            reading.exception()  # retrieved here too, so a failure nobody awaited is not reported as lost

    async def _read(self) -> None:
        # A reading is as old as its replies: loading a new model's tokenizer can outlast a caller's max age.
        taken = time.monotonic()
        try:
            names: list[str] = sorted(await self.redis.smembers(keys.models()))  # type: ignore[misc,arg-type]
            since = time.time() - self.settings.worker_ttl
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.hget(keys.model(name), "digest")
                pipe.zcount(keys.workers(name), since, "+inf")
            replies = await pipe.execute()
            known = await adapters.read_all(self.redis)
            digests = dict(zip(names, replies[::2], strict=True))
            for name, digest in digests.items():
                if digest is not None and (name not in self.served or self.served[name].digest != digest):
                    await self._load(name)
        except aioredis.RedisError:
            raise RedisUnreachable() from None
        self.served = {n: m for n, m in self.served.items() if digests.get(n) is not None}
        self.workers = {n: w for n, w in zip(names, replies[1::2], strict=True) if n in self.served}
        self.adapters = known
        self.read_at = taken

    async def _load(self, name: str) -> None:
        fields: dict[str, Any] = await self.redis.hgetall(keys.model(name))  # type: ignore[misc,assignment]
        if "record" in fields:  # not unregistered meanwhile
            info, created, digest = await self.off_loop(registry.read_entry, fields)
            trust = self.settings.trust_request_chat_template
            self.served[name] = await self.off_loop(ServedModel.build, info, created, digest, trust)
