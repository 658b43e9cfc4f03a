"""A job's events from Redis, complete and in order, for any client at any time.

Pub/sub alone loses what was published before a client subscribed, and the log alone would need polling. So:
subscribe to the live channel first, wait until Redis confirms it, then replay the log, then follow the channel,
dropping every event whose sequence number was already sent and refilling from the log if one was skipped.

One pub/sub connection per API process carries the live channels of all its streams: a reader task hands each
message to the queues of that channel's streams. Hundreds of streams then cost one socket, and one read brings in
the messages of many of them at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

import anyio
import redis.asyncio as aioredis

from shared import keys
from shared.protocol import Event, EventKind

log = logging.getLogger(__name__)

# Put in every queue when the shared connection broke: what was published meanwhile must be read from the log.
RESYNC = ""


class Relay:
    def __init__(self, client: aioredis.Redis):
        self.redis = client
        self._pubsub: aioredis.client.PubSub | None = None
        self._queues: dict[str, set[asyncio.Queue[str]]] = {}
        # Redis confirms SUBSCRIBEs in the order they were sent, so confirmations are matched first come, first served.
        self._confirms: dict[str, deque[asyncio.Future[None]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def _open(self, channel: str) -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        async with self._lock:
            if self._pubsub is None:
                self._pubsub = self.redis.pubsub()
            listeners = self._queues.setdefault(channel, set())
            listeners.add(queue)
            confirmed: asyncio.Future[None] | None = None
            if len(listeners) == 1:
                confirmed = asyncio.get_running_loop().create_future()
                self._confirms.setdefault(channel, deque()).append(confirmed)
                await self._pubsub.subscribe(channel)
                if self._reader is None or self._reader.done():
                    self._reader = asyncio.create_task(self._read())
        if confirmed is not None:
            await confirmed
        return queue

    async def _close(self, channel: str, queue: asyncio.Queue[str]) -> None:
        async with self._lock:
            listeners = self._queues.get(channel)
            if listeners is None:
                return
            listeners.discard(queue)
            if not listeners and self._pubsub is not None:
                del self._queues[channel]
                await self._pubsub.unsubscribe(channel)

    async def _read(self) -> None:
        assert self._pubsub is not None
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=None)
            except (aioredis.ConnectionError, aioredis.TimeoutError):
                # redis-py reconnects and resubscribes on the next read; meanwhile messages may have been lost.
                log.warning("pub/sub connection lost; streams resync from the log")
                for listeners in self._queues.values():
                    for q in listeners:
                        q.put_nowait(RESYNC)
                await asyncio.sleep(0.1)
                continue
            if msg is None:
                continue
            channel = msg["channel"]
            if msg["type"] == "message":
                for q in self._queues.get(channel, ()):
                    q.put_nowait(msg["data"])
            elif msg["type"] == "subscribe":
                pending = self._confirms.get(channel)
                if pending:
                    fut = pending.popleft()
                    if not fut.done():
                        fut.set_result(None)
                if not pending:
                    self._confirms.pop(channel, None)

    async def _log(self, job_id: str, after: int) -> list[Event]:
        entries = await self.redis.xrange(keys.events(job_id), min=f"0-{after + 1}")
        return [Event.from_json(fields["msg"]) for _, fields in entries]

    async def batches(self, job_id: str, after: int = 0) -> AsyncIterator[list[Event]]:
        """Every event of the job with seq > after, each once and in order, in batches of whatever arrived
        together; the last batch ends with the `done` event."""
        channel = keys.live(job_id)
        queue = await self._open(channel)
        try:
            last = after
            backlog = await self._log(job_id, last)
            while True:
                batch = []
                for event in backlog:
                    if event.seq != last + 1:
                        continue
                    last = event.seq
                    batch.append(event)
                    if event.event is EventKind.done:
                        yield batch
                        return
                if batch:
                    yield batch
                raw = [await queue.get()]
                while not queue.empty():
                    raw.append(queue.get_nowait())
                backlog = [] if RESYNC in raw else [Event.from_json(m) for m in raw]
                # Ahead of what was sent (or the connection broke): something was missed, so read the log again.
                if RESYNC in raw or backlog and backlog[0].seq > last + 1:
                    backlog = await self._log(job_id, last)
        finally:
            # Shielded: a client that went away cancels this generator, and the channel must still be released.
            with anyio.CancelScope(shield=True):
                await self._close(channel, queue)

    async def events(self, job_id: str, after: int = 0) -> AsyncIterator[Event]:
        async for batch in self.batches(job_id, after):
            for event in batch:
                yield event
