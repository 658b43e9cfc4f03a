"""A job's events from Redis, complete and in order, for any client at any time.

Pub/sub alone loses what was published before a client subscribed, and the log alone would need polling. So:
subscribe to the live channel first, wait until Redis confirms it, then replay the log, then follow the channel,
dropping every event whose sequence number was already sent and refilling from the log if one was skipped.

One pub/sub connection per API process carries the live channels of all its streams: a reader task hands each
message to the inboxes of that channel's streams. Hundreds of streams then cost one socket, and one read brings in
the messages of many of them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import parse_url

from chatq.core import keys
from chatq.core.protocol import Event, EventKind, error_body

log = logging.getLogger(__name__)

# Seconds between two warnings of the same outage.
WARN_INTERVAL = 10.0

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


def _command(*args: str) -> bytes:
    return hiredis.pack_command(args)  # type: ignore[arg-type]  # the stub types it as a 1-tuple


class Subscriber:
    """The pub/sub connection, spoken to directly: hiredis parses every reply of a socket read in one call.

    redis-py's PubSub spends about 13 us of Python per message and this reader about 1 us, and at thousands of
    relayed chunks per second that was a fifth of the API's CPU. The connection is redis-py's URL, parsed by it.
    """

    def __init__(self, url: str, on_message: Callable[[str, str], None]):
        self.options: dict[str, Any] = dict(parse_url(url))
        self.on_message = on_message
        # Redis confirms SUBSCRIBEs in the order they were sent, so each confirmation runs the oldest callback
        # waiting on its channel.
        self._confirms: dict[str, deque[Callable[[], None]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._wanted: dict[str, Callable[[], None]] = {}  # channel -> what runs when its subscription is confirmed

    def subscribe(self, channel: str, confirmed: Callable[[], None]) -> None:
        self._wanted[channel] = confirmed
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        elif self._writer is not None:  # else the connection being made subscribes everything wanted
            self._confirms.setdefault(channel, deque()).append(confirmed)
            self._writer.write(_command("SUBSCRIBE", channel))

    def unsubscribe(self, channel: str) -> None:
        self._wanted.pop(channel, None)
        if self._writer is not None:
            self._writer.write(_command("UNSUBSCRIBE", channel))

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        o = self.options
        if "path" in o:
            reader, writer = await asyncio.open_unix_connection(o["path"])
        else:
            tls = ssl.create_default_context() if o.get("connection_class") is aioredis.SSLConnection else None
            reader, writer = await asyncio.open_connection(o.get("host", "localhost"), o.get("port", 6379), ssl=tls)
            sock = writer.get_extra_info("socket")
            if sock is not None:  # a peer that vanished without a reset is noticed
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if o.get("password"):
            user = (o["username"],) if o.get("username") else ()
            writer.write(_command("AUTH", *user, o["password"]))
            parser = hiredis.Reader(encoding="utf-8")
            while (reply := parser.gets()) is False:
                data = await reader.read(4096)
                if not data:
                    raise ConnectionError("Redis closed the connection during AUTH")
                parser.feed(data)
            if isinstance(reply, hiredis.ReplyError):
                raise reply
        return reader, writer

    async def _run(self) -> None:
        warned_at = -WARN_INTERVAL
        while self._wanted:
            try:
                reader, writer = await self._connect()
            except (OSError, hiredis.ReplyError) as e:
                if (now := time.monotonic()) - warned_at >= WARN_INTERVAL:
                    warned_at = now
                    log.warning("pub/sub connection failed (%s); retrying every 0.5 s", e)
                await asyncio.sleep(0.5)
                continue
            warned_at = -WARN_INTERVAL
            self._confirms = {c: deque([confirmed]) for c, confirmed in self._wanted.items()}
            for channel in self._wanted:
                writer.write(_command("SUBSCRIBE", channel))
            self._writer = writer
            try:
                await self._read(reader)
            except (OSError, hiredis.ProtocolError) as e:
                log.warning("pub/sub connection lost (%s); streams resync from the log", e)
            except Exception:  # whatever it was, the streams must not stall: start afresh, they resync
                log.exception("pub/sub reader failed; streams resync from the log")
                await asyncio.sleep(0.5)
            finally:
                self._writer = None
                writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        # A message that is not UTF-8 (not one of ours) becomes one a stream cannot read, not a dead reader.
        parser = hiredis.Reader(encoding="utf-8", errors="replace")
        while data := await reader.read(1 << 16):
            parser.feed(data)
            while (reply := parser.gets()) is not False:
                if isinstance(reply, hiredis.ReplyError):  # e.g. the server now wants AUTH: start afresh
                    raise ConnectionError(f"Redis refused a pub/sub command: {reply}")
                kind = reply[0]
                if kind == "message":
                    self.on_message(reply[1], reply[2])
                elif kind == "subscribe":
                    pending = self._confirms.get(reply[1])
                    if pending:
                        pending.popleft()()
                        if not pending:
                            del self._confirms[reply[1]]
        raise ConnectionError("Redis closed the pub/sub connection")


class Relay:
    def __init__(self, client: aioredis.Redis, url: str):
        self.redis = client
        self._channels: dict[str, Channel] = {}
        self._subscriber = Subscriber(url, self._deliver)
        # During an outage every open stream retries its log read: one warning per interval says so for all of them.
        self._warned_at = -WARN_INTERVAL

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
        """The job's logged events after `after`, and whether the job still exists.

        The events are None if the log's key holds another type of value, so the log will never be read (the
        worker still publishes the job's events live). A job whose record is gone (deleted, expired) gets no more
        events: its worker writes only those of jobs that exist. While Redis is unreachable or loading its data,
        this waits for it, as the worker does, rather than end a stream whose job goes on.
        """
        delay = 0.1
        while True:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xrange(keys.events(job_id), min=f"0-{after + 1}")
            pipe.exists(keys.job(job_id))
            try:
                entries, exists = await pipe.execute(raise_on_error=False)
                break
            except (aioredis.ConnectionError, aioredis.TimeoutError) as e:
                if (now := time.monotonic()) - self._warned_at >= WARN_INTERVAL:
                    self._warned_at = now
                    log.warning("reading job logs failed (%s); their streams wait and try again", e)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
        if isinstance(exists, Exception):
            raise exists
        if isinstance(entries, Exception):
            if not str(entries).startswith("WRONGTYPE"):
                raise entries
            return None, bool(exists)
        return [Event.from_json(fields["msg"]) for _, fields in entries], bool(exists)

    async def last_seq(self, job_id: str) -> int | None:
        """The number of the job's last logged event, 0 if none is; None if its log cannot be read."""
        try:
            entries: list[tuple[str, dict[str, str]]] = await self.redis.xrevrange(  # type: ignore[assignment]
                keys.events(job_id), count=1
            )
        except aioredis.ResponseError:
            return None
        return int(entries[0][0].split("-")[1]) if entries else 0

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
                    yield ending(last, LOST)
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
                    # A job's log is written in order, so a gap in it stays: end the stream and say so, rather
                    # than wait for an event that will never come or go on with a hole in the text.
                    yield [*batch, *ending(last, LOST)]
                    return
                if from_log and not exists:  # deleted or expired: what the log held is all there will be
                    yield [*batch, *ending(last, GONE, "NotFoundError", 404)]
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


def ending(last: int, message: str, type_: str = "InternalServerError", code: int = 500) -> list[Event]:
    """How a stream ends when it cannot go on: an error, then `done`. Both carry `last`'s number, so a client that
    resumes from them reads on from where this stream stopped."""
    return [Event(last, EventKind.error, error_body(message, type_, code)), Event(last, EventKind.done)]


# The event after the last one sent never reached the log (a worker could not write it): a client that resumes meets
# the same gap, not a text with a hole in it.
LOST = "Part of this job's output was lost before it could be relayed."
GONE = "The job was deleted or has expired."
