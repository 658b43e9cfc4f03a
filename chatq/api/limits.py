"""A managed key's requests and tokens per minute on what it submits, as OpenAI answers them (chatq.core.rate_limits
keeps the buckets).

A request takes prompt plus max_tokens of each choice as it is accepted; once its job ends, what it did not use goes
back, so a key that asks for long answers and gets short ones is not held to the long ones. A request that takes
nothing new (an idempotent repeat) or is refused after taking gives everything back.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from chatq.api.relay import Relay
from chatq.core import rate_limits, sampling
from chatq.core.api_keys import ApiKey
from chatq.core.errors import RateLimited
from chatq.core.model_info import ModelInfo
from chatq.core.rate_limits import Verdict, duration
from chatq.core.requests import GenerationRequest

log = logging.getLogger(__name__)


def reserved_tokens(body: GenerationRequest, prompts: list[list[int]], info: ModelInfo) -> int:
    """What a request takes from its key's tokens per minute: each prompt, and max_tokens for each of its choices."""
    total = 0
    for prompt in prompts:
        room = info.max_model_len - len(prompt)
        total += len(prompt) + body.candidates * sampling.max_tokens(body.max_new_tokens, info.sampling_defaults, room)
    return total


@dataclass
class Taken:
    """What one accepted request took from its key, to give back what it does not use."""

    key: ApiKey
    verdict: Verdict

    def headers(self) -> dict[str, str]:
        return self.verdict.headers()


class Limits:
    def __init__(self, client: aioredis.Redis, relay: Relay):
        self.redis = client
        self.relay = relay
        self._returns: set[asyncio.Task[None]] = set()

    async def take(self, key: ApiKey | None, owner: str, model: str, tokens: int) -> Taken | None:
        """Takes the request from the key's buckets; None for a key without limits. Raises RateLimited."""
        if key is None or not (key.limits.rpm or key.limits.tpm):
            return None
        tpm = key.limits.tpm
        if tpm and tokens > tpm:
            raise RateLimited(
                f"Request too large for {model} on tokens per min (TPM): Limit {tpm}, Requested {tokens}. The input "
                "or output tokens must be reduced in order to run successfully.",
                "tokens",
                {"x-should-retry": "false"},
            )
        verdict = await rate_limits.take(self.redis, owner, key.limits.rpm, tpm, tokens)
        if not verdict.taken:
            raise _refusal(verdict, model)
        return Taken(key, verdict)

    async def give_back(self, owner: str, taken: Taken | None, request: bool, tokens: int) -> None:
        if taken is None or (not request and tokens <= 0):
            return
        limits = taken.key.limits
        await rate_limits.give_back(self.redis, owner, limits.rpm, limits.tpm, request, tokens)

    def give_back_unused(self, owner: str, taken: Taken | None, job_id: str) -> None:
        """Once the job ends, gives back the tokens it took and did not use (all its max_tokens if it ended without
        an answer's usage: a failure or a cancel generated few)."""
        if taken is None or not taken.key.limits.tpm:
            return
        task = asyncio.create_task(self._after_end(owner, taken, job_id))
        self._returns.add(task)
        task.add_done_callback(self._returns.discard)

    async def _after_end(self, owner: str, taken: Taken, job_id: str) -> None:
        try:
            done = await self.relay.done(job_id)
            used = _used(done.data)
            await self.give_back(owner, taken, False, taken.verdict.tokens - used if used is not None else 0)
        except Exception:  # the bucket refills within a minute anyway
            log.exception("giving back the unused tokens of job %s failed", job_id)

    async def close(self) -> None:
        for task in self._returns:
            task.cancel()
        await asyncio.gather(*self._returns, return_exceptions=True)


def _used(answer: dict[str, Any] | None) -> int | None:
    usage = (answer or {}).get("usage") or {}
    if "total_tokens" in usage:
        return int(usage["total_tokens"])
    return None


def _refusal(verdict: Verdict, model: str) -> RateLimited:
    kind = verdict.refused_on
    if kind == "requests":
        limit, left, requested, unit = verdict.rpm or 0, verdict.requests_left, 1, "requests per min (RPM)"
    else:
        limit, left, requested, unit = verdict.tpm or 0, verdict.tokens_left, verdict.tokens, "tokens per min (TPM)"
    # No request asks for more than its limit, so the wait is under a minute: within what the SDK waits for.
    wait = verdict.wait()
    return RateLimited(
        f"Rate limit reached for {model} on {unit}: Limit {limit}, Used {limit - max(0, math.floor(left))}, "
        f"Requested {requested}. Please try again in {duration(wait)}.",
        kind or "tokens",
        verdict.headers() | {"retry-after": str(math.ceil(wait)), "retry-after-ms": str(math.ceil(wait * 1000))},
    )
