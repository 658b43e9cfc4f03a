"""A Celery app module for a worker whose generator costs nothing: a benchmark test double, never a product mode.

    python -m celery -A bench.zero_worker worker -P threads ...    (from the repository root; queue_overhead.py does)

It imports `chatq.worker.celery_app` (the Celery app, the task, the signals) and swaps its `worker_init` handler, the
one that loads the model, for one that builds the real `Runner` (detokenize, parse, chunks, Redis publish per step)
around `ZeroEngine` (bench/zero_engine.py): each step emits one fixed token (" hello") for every running sequence
and ends a sequence at its max_tokens. Everything but the forward pass is the product's code path. It also
registers a task that does nothing (`NOOP_TASK`), for the cost of Celery alone. For the benchmark's breakdown it
also counts engine steps, tokens, the time spent in `Publisher.flush` and the worker's full garbage collections, and
keeps the totals in the Redis hash `bench.common.STATS_KEY` (rewritten every 0.2 s, with the time they were taken).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import Any

import redis
from celery import signals

from bench.common import NOOP_TASK, STATS_KEY
from bench.zero_engine import ZeroEngine
from chatq.core import registry
from chatq.core.model_info import ModelInfo
from chatq.core.settings import Settings
from chatq.worker import celery_app as product
from chatq.worker.engine import Output
from chatq.worker.publish import Publisher, StepWrites
from chatq.worker.runner import Runner

app = product.app  # what `celery -A bench.zero_worker` looks for
TOKEN_TEXT = " hello"


@app.task(name=NOOP_TASK)
def noop(_job_id: str) -> None:
    """A task that does nothing, on the same app, queue and pool as the product's: what Celery itself costs."""


class Stats:
    """Counters of the engine loop, shared by the engine and the publisher wrapper, and of the worker's full garbage
    collections (every thread stands still during one)."""

    def __init__(self) -> None:
        # Reentrant: a collection, and so its callback, can start inside any allocation, one made under the lock too.
        self._lock = threading.RLock()
        self.values: dict[str, float] = {
            "steps": 0,
            "tokens": 0,
            "flushes": 0,
            "events": 0,
            "flush_s": 0.0,
            "gc_full": 0,
            "gc_full_s": 0.0,
        }
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.add(gc_full=1, gc_full_s=time.perf_counter() - self._gc_started)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.values[k] += v

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values) | {"at": time.time()}

    def report_forever(self, client: redis.Redis) -> None:
        while True:
            with contextlib.suppress(redis.RedisError):
                client.hset(STATS_KEY, mapping=dict[Any, Any](self.snapshot()))
            time.sleep(0.2)


class TimedPublisher(Publisher):
    """The product's Publisher, timed."""

    def __init__(self, client: redis.Redis, settings: Settings, worker: str, stats: Stats):
        super().__init__(client, settings, worker)
        self.stats = stats

    def flush(self, writes: StepWrites) -> Any:
        start = time.perf_counter()
        try:
            return super().flush(writes)
        finally:
            self.stats.add(flushes=1, events=len(writes.events), flush_s=time.perf_counter() - start)


class CountedZeroEngine(ZeroEngine):
    """ZeroEngine, counting its steps and tokens."""

    def __init__(self, token_id: int, stats: Stats):
        super().__init__(token_id)
        self.stats = stats

    def step(self) -> list[Output]:
        outputs = super().step()
        self.stats.add(steps=1, tokens=sum(o.token is not None for o in outputs))
        return outputs


def build_zero_runner(settings: Settings, client: redis.Redis, worker: str, stats: Stats) -> Runner:
    model = ModelInfo.read(settings.model_name, settings.model_dir, settings.max_model_len)  # no weights are read
    ids = model.tokenizer.encode(TOKEN_TEXT, add_special_tokens=False).ids
    if len(ids) != 1:
        raise RuntimeError(f"{TOKEN_TEXT!r} is not one token in this tokenizer: {ids}")
    engine = CountedZeroEngine(ids[0], stats)
    return Runner(lambda: engine, model, TimedPublisher(client, settings, worker, stats), settings=settings)


if not signals.worker_init.disconnect(product._load):
    raise RuntimeError("chatq.worker.celery_app._load is no longer a worker_init handler: update bench/zero_worker.py")


@signals.worker_init.connect
def _load_zero(sender: object = None, **_kwargs: object) -> None:
    client = redis.Redis.from_url(product.settings.redis_url, decode_responses=True)
    stats = Stats()
    name = getattr(sender, "hostname", "worker")
    runner = build_zero_runner(product.settings, client, name, stats)
    runner.start()
    threading.Thread(target=stats.report_forever, args=(client,), name="bench-stats", daemon=True).start()
    entry = registry.entry(runner.model)
    registry.register(client, entry)  # as the product's worker does, so the API serves its model
    product._state = product.WorkerState(client, runner, name, entry)
