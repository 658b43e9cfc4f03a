"""A key's buckets in a real Redis: taken from all at once or not at all, refilled over the minute, given back up to
the limit; and their headers as OpenAI writes them."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from chatq.core.rate_limits import duration, give_back, take


def test_waits_read_as_openais():
    assert [duration(s) for s in (0.0004, 0.02, 1.0, 1.5741, 59.9991, 60, 360, 90.2)] == [
        "1ms",
        "20ms",
        "1s",
        "1.575s",
        "60s",
        "1m0s",
        "6m0s",
        "1m31s",
    ]


def run(settings, body):
    async def go():
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        try:
            return await body(client, uuid.uuid4().hex)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_request_takes_from_both_buckets_or_from_neither(settings):
    async def body(client, owner):
        first = await take(client, owner, 2, 100, 60)
        assert first.taken and first.headers() == {
            "x-ratelimit-limit-requests": "2",
            "x-ratelimit-remaining-requests": "1",
            "x-ratelimit-reset-requests": "30s",
            "x-ratelimit-limit-tokens": "100",
            "x-ratelimit-remaining-tokens": "40",
            "x-ratelimit-reset-tokens": "36s",
        }
        too_many_tokens = await take(client, owner, 2, 100, 60)
        assert not too_many_tokens.taken and too_many_tokens.refused_on == "tokens"
        assert 11.9 < too_many_tokens.wait() <= 12.0  # 20 tokens short at 100 a minute
        fits = await take(client, owner, 2, 100, 40)  # the refusal took no request: one is left
        assert fits.taken and int(fits.headers()["x-ratelimit-remaining-requests"]) == 0
        refused = await take(client, owner, 2, 100, 1)
        assert refused.refused_on == "requests" and 29 < refused.wait() <= 30
        await give_back(client, owner, 2, 100, True, 1000)  # never past the limit
        full = await take(client, owner, 2, 100, 100)
        assert full.taken and full.tokens_left < 1 and full.requests_left < 1.01

    run(settings, body)


def test_a_bucket_refills_over_the_minute(settings):
    async def body(client, owner):
        assert (await take(client, owner, None, 6000, 6000)).taken  # 100 tokens a second
        await asyncio.sleep(0.3)
        later = await take(client, owner, None, 6000, 20)
        assert later.taken and 9 <= later.tokens_left <= 6000
        assert "x-ratelimit-limit-requests" not in later.headers()

    run(settings, body)
