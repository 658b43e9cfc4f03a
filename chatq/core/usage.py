"""What each API key used, by day (UTC) and model: requests, input and output tokens. Each job's last write adds its
own, once (chatq.core.worker_scripts); the admin reads any key's, and a key its own."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from chatq.core import keys
from chatq.core.metrics import GENERATION_TOKENS, PROMPT_TOKENS

KEPT_DAYS = 90
TOTAL = "total"  # in place of a day: since the key was first used, kept as long as Redis keeps data
MEASURES = ("requests", "input_tokens", "output_tokens")


def day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def measures(metrics: Mapping[str, float]) -> dict[str, int]:
    """A job's usage, from what it adds to its model's metrics."""
    return {
        "requests": 1,
        "input_tokens": int(metrics.get(PROMPT_TOKENS, 0)),
        "output_tokens": int(metrics.get(GENERATION_TOKENS, 0)),
    }


def by_model(held: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """A usage hash's fields (`{model}|{measure}`) -> {model: {measure: amount}}, every measure present."""
    out: dict[str, dict[str, int]] = {}
    for field, amount in held.items():
        model, _, measure = field.rpartition("|")
        out.setdefault(model, dict.fromkeys(MEASURES, 0))[measure] = int(amount)
    return out


async def read(client: aioredis.Redis, owner: str, days: int, now: float) -> list[dict[str, Any]]:
    """The owner's usage over the last `days` days (today's so far included), a row per day and model, oldest first."""
    dates = [day(now - back * 86400) for back in range(days - 1, -1, -1)]
    pipe = client.pipeline(transaction=False)
    for date in dates:
        pipe.hgetall(keys.usage(date, owner))
    rows = []
    for date, held in zip(dates, await pipe.execute(), strict=True):
        found = by_model(held)
        rows += [{"date": date, "model": model} | found[model] for model in sorted(found)]
    return rows


async def totals(client: aioredis.Redis, owners: list[str]) -> list[dict[str, dict[str, int]]]:
    """Each owner's usage since it began, by model."""
    pipe = client.pipeline(transaction=False)
    for owner in owners:
        pipe.hgetall(keys.usage(TOTAL, owner))
    return [by_model(held) for held in await pipe.execute()]
