"""A job's events from Redis, complete and in order, for any client at any time.

Pub/sub alone misses what was published before subscribing; the log alone needs polling. So a stream subscribes,
waits for Redis to confirm, replays the log, then follows the channel, dropping repeats and rereading the log after
a gap. All streams share one pub/sub connection (Subscriber).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from chatq.api.subscriber import WARN_INTERVAL, Subscriber
from chatq.core import keys
from chatq.core.errors import ChatqError, JobGone, OutputLost
from chatq.core.job import Event, EventKind
from chatq.core.retry import Retry

log = logging.getLogger(__name__)

# Put in every inbox when the shared connection broke: what was published meanwhile must be read from the log.
RESYNC = ""


class Inbox:
    """One stream's undelivered messages; the stream takes them all at once."""

    def __init__(self) -> None:
        self._items: list[str] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, item: str) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[str]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


class Channel:
    def __init__(self) -> None:
        self.inboxes: set[Inbox] = set()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class Relay:
    def __init__(self, client: aioredis.Redis, url: str):
        self.redis = client
        self._channels: dict[str, Channel] = {}
        self._subscriber = Subscriber(url, self._deliver)
        # During an outage every open stream retries its log read: one warning per interval says so for all of them.
        self._retry = Retry(log, "reading job logs failed; their streams wait", warn_every=WARN_INTERVAL)

    def _deliver(self, channel: str, message: str) -> None:
        ch = self._channels.get(channel)
        if ch is not None:
            for inbox in ch.inboxes:
                inbox.push(message)

    @staticmethod
    def _confirmer(ch: Channel) -> Callable[[], None]:
        def confirmed() -> None:
            if not ch.ready.done():
                ch.ready.set_result(None)
                return
            # A confirmed channel confirmed again was resubscribed after the connection broke: what was published
            # meanwhile is only in the log.
            for inbox in ch.inboxes:
                inbox.push(RESYNC)

        return confirmed

    async def _open(self, name: str) -> Inbox:
        inbox = Inbox()
        ch = self._channels.get(name)
        if ch is None:
            ch = self._channels[name] = Channel()
            self._subscriber.subscribe(name, self._confirmer(ch))
        ch.inboxes.add(inbox)
        try:
            # Every stream of the channel waits for the confirmation: before it, a published event reaches no one.
            await asyncio.shield(ch.ready)
        except BaseException:
            self._close(name, inbox)
            raise
        return inbox

    def _close(self, name: str, inbox: Inbox) -> None:
        ch = self._channels.get(name)
        if ch is None:
            return
        ch.inboxes.discard(inbox)
        if not ch.inboxes:
            del self._channels[name]
            self._subscriber.unsubscribe(name)

    async def _log(self, job_id: str, after: int) -> tuple[list[Event] | None, bool]:
        """The job's logged events after `after` (None if the key holds another type: the log can never be read),
        and whether the job still exists: a worker writes events only for jobs that exist. While Redis is unreachable
        or loading, this waits, as the worker does, rather than end a stream whose job goes on."""

        def read() -> Awaitable[list[Any]]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xrange(keys.events(job_id), min=f"0-{after + 1}")
            pipe.exists(keys.job(job_id))
            return pipe.execute(raise_on_error=False)

        entries, exists = await self._retry.arun(read)
        if isinstance(exists, Exception):
            raise exists
        if isinstance(entries, Exception):
            if not str(entries).startswith("WRONGTYPE"):
                raise entries
            return None, bool(exists)
        return [Event.from_json(fields["msg"]) for _, fields in entries], bool(exists)

    async def last_seq(self, job_id: str) -> int | None:
        """The number of the job's last logged event, 0 if none is; None if its log cannot be read."""
        return await last_seq(self.redis, job_id)

    async def batches(self, job_id: str, after: int = 0) -> AsyncGenerator[list[Event], None]:
        """Every event of the job with seq > after, each once and in order, in batches of whatever arrived
        together; the last batch ends with the `done` event."""
        channel = keys.live(job_id)
        inbox = await self._open(channel)
        try:
            last = after
            (backlog, exists), from_log = await self._log(job_id, last), True
            while True:
                if backlog is None:  # what this stream lacks is only in a log that cannot be read
                    yield ending(last, OutputLost())
                    return
                batch, gap = [], False
                for event in backlog:
                    if event.seq <= last:
                        if event.event is EventKind.done:  # resumed past the end: nothing more will come
                            return
                        continue
                    if event.seq > last + 1:
                        gap = True
                        break
                    last = event.seq
                    batch.append(event)
                    if event.event is EventKind.done:
                        yield batch
                        return
                if gap and from_log:
                    # A job's log is written in order, so a gap in it is permanent: end the stream saying so,
                    # rather than wait forever or leave a hole in the text.
                    yield [*batch, *ending(last, OutputLost())]
                    return
                if from_log and not exists:  # deleted or expired: what the log held is all there will be
                    yield [*batch, *ending(last, JobGone())]
                    return
                if batch:
                    yield batch
                if gap:  # a message was missed: the log has it
                    (backlog, exists), from_log = await self._log(job_id, last), True
                    continue
                raw = await inbox.take()
                if RESYNC in raw:  # the connection broke: what was published meanwhile is only in the log
                    (backlog, exists), from_log = await self._log(job_id, last), True
                else:
                    backlog, from_log = [Event.from_json(m) for m in raw], False
        finally:
            self._close(channel, inbox)

    async def events(self, job_id: str, after: int = 0) -> AsyncGenerator[Event, None]:
        async with contextlib.aclosing(self.batches(job_id, after)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    async def done(self, job_id: str, after: int = 0) -> Event:
        """The job's `done` event, once it ended."""
        # Closed here, not by the garbage collector: closing leaves the job's channel.
        async with contextlib.aclosing(self.events(job_id, after)) as events:
            async for event in events:
                if event.event is EventKind.done:
                    return event
        raise RuntimeError("a job's events ended without `done`")


def ending(last: int, error: ChatqError) -> list[Event]:
    """How a stream ends when it cannot go on: an error, then `done`. Both carry `last`'s number, so a client that
    resumes from them reads on from where this stream stopped."""
    return [Event(last, EventKind.error, error.body()), Event(last, EventKind.done)]


async def last_seq(client: aioredis.Redis, job_id: str) -> int | None:
    """The number of the job's last logged event, 0 if none is; None if its log cannot be read (another type of
    value holds its key)."""
    try:
        entries: list[tuple[str, dict[str, str]]] = await client.xrevrange(  # type: ignore[assignment]
            keys.events(job_id), count=1
        )
    except aioredis.ResponseError:
        return None
    return int(entries[0][0].split("-")[1]) if entries else 0
