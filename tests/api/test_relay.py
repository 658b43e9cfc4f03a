"""The relay against a real Redis, fed by the worker's own publishing script: every event once, in order, whatever
happened to the pub/sub connection or to when the stream started."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
import redis
import redis.asyncio as aioredis

from chatq.api.relay import Relay
from chatq.core import keys, worker_scripts
from chatq.core.job import Event, EventKind
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port


def record(r: redis.Redis, job_id: str) -> None:
    """The job's record, which exists before any stream of it opens: a stream of a job without one ends at once."""
    r.hsetnx(keys.job(job_id), "id", job_id)
    r.hsetnx(keys.job(job_id), "status", "in_progress")


def publish(r: redis.Redis, job_id: str, *seqs: int, last: int) -> None:
    """Events `seqs` of a job in the worker's format; `last` is its done event."""
    events = []
    for s in seqs:
        data = None if s == last else {"choices": [{"delta": {"content": f"t{s}"}}]}
        events.append((job_id, Event(s, EventKind.done if s == last else EventKind.chunk, data)))
    record(r, job_id)  # the worker writes only the events of jobs that exist
    pipe = r.pipeline(transaction=False)
    worker_scripts.publish_events(pipe, "relay-test", events)
    pipe.execute()


async def events(relay: Relay, job_id: str, after: int = 0) -> list[Event]:
    return [e async for e in relay.events(job_id, after)]


async def collect(relay: Relay, job_id: str, after: int = 0) -> list[int]:
    return [e.seq for e in await events(relay, job_id, after)]


async def until_subscribed(r: aioredis.Redis, channel: str) -> None:
    while not (await r.pubsub_numsub(channel))[0][1]:
        await asyncio.sleep(0.01)


@pytest.mark.timeout(30)
def test_every_event_once_across_a_broken_pubsub_connection(tmp_path) -> None:
    # A Redis of its own: killing every pub/sub connection of the session's Redis would also cut the session
    # worker's broker connection (Celery's remote-control channel), which then restores its unacknowledged task
    # messages and reconnects under whatever test comes next.
    server = EmbeddedRedis(tmp_path, persist=False).start()
    job = "chatcmpl-relay-broken"
    try:
        r = redis.Redis(port=server.port)
        record(r, job)

        async def main() -> list[int]:
            client = aioredis.Redis.from_url(server.url, decode_responses=True)
            relay = Relay(client, server.url)
            stream = asyncio.create_task(collect(relay, job))
            await until_subscribed(client, keys.live(job))
            publish(r, job, 1, 2, 3, last=7)
            await asyncio.sleep(0.1)
            assert r.client_kill_filter(_type="pubsub") >= 1
            # The rest, up to `done`, while the relay has no connection (this coroutine does not yield in between):
            # only the log has them, and no later message reveals the gap.
            publish(r, job, 4, 5, 6, 7, last=7)
            seqs = await stream
            await client.aclose()
            return seqs

        assert asyncio.run(main()) == list(range(1, 8))
    finally:
        server.stop()


@pytest.mark.timeout(30)
def test_late_and_resumed_streams_replay_the_log(settings: Settings, r: redis.Redis) -> None:
    job = "chatcmpl-relay-late"
    publish(r, job, 1, 2, 3, last=6)

    async def main() -> tuple[list[int], list[int]]:
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        relay = Relay(client, settings.redis_url)
        full = asyncio.create_task(collect(relay, job))
        resumed = asyncio.create_task(collect(relay, job, after=2))  # a second stream on the same channel
        await until_subscribed(client, keys.live(job))
        publish(r, job, 4, 5, 6, last=6)
        out = await full, await resumed
        assert (await client.pubsub_numsub(keys.live(job)))[0][1] == 0  # both streams released the channel
        await client.aclose()
        return out

    full, resumed = asyncio.run(main())
    assert full == [1, 2, 3, 4, 5, 6]
    assert resumed == [3, 4, 5, 6]


def follow_then_read(
    settings: Settings, job: str, during: Callable[[list[Event]], Awaitable[None]], *afters: int
) -> list[list[Event]]:
    """The events of a stream that follows `job` live while `during` runs (given the list they arrive in), then of
    streams started afterwards from each of `afters`."""
    record(redis.Redis.from_url(settings.redis_url), job)

    async def main() -> list[list[Event]]:
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        relay = Relay(client, settings.redis_url)
        seen: list[Event] = []

        async def follow() -> list[Event]:
            async for event in relay.events(job):
                seen.append(event)
            return seen

        live = asyncio.create_task(follow())
        await until_subscribed(client, keys.live(job))
        await during(seen)
        out = [await live] + [await events(relay, job, after) for after in afters]
        await client.aclose()
        return out

    return asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_stream_missing_an_event_ends_with_an_error_instead_of_waiting(settings: Settings, r: redis.Redis) -> None:
    job = "chatcmpl-relay-lost"

    async def steps(_: list[Event]) -> None:
        publish(r, job, 1, 2, last=5)
        publish(r, job, 4, 5, last=5)  # a step with event 3 never landed

    chunks = [(1, EventKind.chunk), (2, EventKind.chunk)]
    # Followed live, read from the log afterwards, resumed at the gap.
    got = follow_then_read(settings, job, steps, 0, 2)
    for stream, before in zip(got, [chunks, chunks, []], strict=True):
        assert [(e.seq, e.event) for e in stream] == [*before, (2, EventKind.error), (2, EventKind.done)]
        assert stream[-2].data is not None and stream[-2].data["error"]["code"] == 500


@pytest.mark.timeout(30)
def test_a_job_whose_log_was_overwritten_reaches_its_live_streams_and_fails_later_ones(
    settings: Settings, r: redis.Redis
) -> None:
    job = "chatcmpl-relay-clobbered"

    async def steps(seen: list[Event]) -> None:
        publish(r, job, 1, 2, last=4)
        while len(seen) < 2:  # until the live stream has read the log and follows the channel
            await asyncio.sleep(0.01)
        r.delete(keys.events(job))
        r.set(keys.events(job), "not a stream")
        publish(r, job, 3, 4, last=4)

    live, late = follow_then_read(settings, job, steps, 0)
    assert [(e.seq, e.event) for e in live] == [(s, EventKind.chunk) for s in (1, 2, 3)] + [(4, EventKind.done)]
    assert [(e.seq, e.event) for e in late] == [(0, EventKind.error), (0, EventKind.done)]


@pytest.mark.timeout(30)
def test_a_password_protected_redis(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path, persist=False).start()
    job = "chatcmpl-relay-auth"
    try:
        admin = redis.Redis(port=server.port)
        admin.config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        r = redis.Redis.from_url(url)
        record(r, job)

        async def main() -> list[int]:
            client = aioredis.Redis.from_url(url, decode_responses=True)
            relay = Relay(client, url)
            stream = asyncio.create_task(collect(relay, job))
            await until_subscribed(client, keys.live(job))
            publish(r, job, 1, 2, last=2)
            seqs = await stream
            await client.aclose()
            return seqs

        assert asyncio.run(main()) == [1, 2]
    finally:
        server.stop()


@pytest.mark.timeout(30)
def test_a_foreign_message_on_one_channel_stalls_no_other_stream(settings: Settings, r: redis.Redis) -> None:
    polluted, clean = "chatcmpl-relay-polluted", "chatcmpl-relay-clean"
    for job in (polluted, clean):
        record(r, job)

    async def main() -> list[int]:
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        relay = Relay(client, settings.redis_url)
        bad = asyncio.create_task(collect(relay, polluted))
        good = asyncio.create_task(collect(relay, clean))
        await until_subscribed(client, keys.live(polluted))
        await until_subscribed(client, keys.live(clean))
        r.publish(keys.live(polluted), b"\xff\xfe not ours")  # not even UTF-8
        await asyncio.sleep(0.1)
        publish(r, clean, 1, 2, 3, last=3)
        seqs = await good
        bad.cancel()
        await client.aclose()
        return seqs

    assert asyncio.run(main()) == [1, 2, 3]


@pytest.mark.timeout(30)
def test_a_stream_of_a_job_deleted_before_it_subscribed_ends_instead_of_waiting(
    settings: Settings, r: redis.Redis
) -> None:
    # As when a DELETE lands between the API's read of the job and its subscription: the closing events were
    # published to no one and the record and log are gone, so nothing more will ever come.
    async def main() -> list[Event]:
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        got = await events(Relay(client, settings.redis_url), "chatcmpl-relay-deleted")
        await client.aclose()
        return got

    got = asyncio.run(main())
    assert [(e.seq, e.event) for e in got] == [(0, EventKind.error), (0, EventKind.done)]
    assert got[0].data is not None and got[0].data["error"]["code"] == 404


@pytest.mark.timeout(60)
def test_a_stream_waits_through_a_redis_restart(tmp_path) -> None:
    servers = [EmbeddedRedis(tmp_path).start()]
    port, job = servers[0].port, "chatcmpl-relay-restart"
    try:
        r = redis.Redis(port=port)
        record(r, job)

        async def main() -> list[int]:
            # Built as the API builds it: from a pool, whose connections do not retry a command on their own.
            pool = aioredis.ConnectionPool.from_url(servers[0].url, decode_responses=True)
            client = aioredis.Redis(connection_pool=pool)
            relay = Relay(client, servers[0].url)
            seen: list[int] = []

            async def follow() -> None:
                async for event in relay.events(job):
                    seen.append(event.seq)

            stream = asyncio.create_task(follow())
            await until_subscribed(client, keys.live(job))
            publish(r, job, 1, 2, last=4)
            while len(seen) < 2:
                await asyncio.sleep(0.01)
            servers[0].stop()  # its data is on disk: the restart loses nothing
            await asyncio.sleep(0.5)
            servers[0] = EmbeddedRedis(tmp_path)
            servers[0].port = port
            servers[0].start()
            publish(r, job, 3, 4, last=4)  # before the relay is back on the channel: only the log has them
            await stream
            await client.aclose()
            return seen

        assert asyncio.run(main()) == [1, 2, 3, 4]
    finally:
        servers[0].stop()


@pytest.mark.timeout(30)
def test_streams_waiting_out_an_outage_warn_once_between_them(
    settings: Settings, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = [f"chatcmpl-relay-outage-{i}" for i in range(5)]
    for job in jobs:
        record(r, job)

    async def main() -> None:
        # Pub/sub reaches Redis, the log reads do not: every stream retries its read.
        unreachable = aioredis.Redis(port=free_port(), retry=None)
        relay = Relay(unreachable, settings.redis_url)
        streams = [asyncio.create_task(collect(relay, job)) for job in jobs]
        await asyncio.sleep(1.5)
        assert not any(s.done() for s in streams)
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="chatq.api.relay"):
        asyncio.run(main())
    warnings = [rec for rec in caplog.records if "reading job logs failed" in rec.getMessage()]
    assert len(warnings) == 1
