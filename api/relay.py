"""A job's events from Redis, complete and in order, for any client at any time.

Pub/sub alone loses what was published before a client subscribed, and the log alone would need polling. So:
subscribe to the live channel first, wait until Redis confirms it, then replay the log, then follow the channel,
dropping every event whose sequence number was already sent and refilling from the log if one was skipped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from shared import keys
from shared.protocol import Event, EventKind


class Relay:
    def __init__(self, client: aioredis.Redis):
        self.redis = client

    async def _log(self, job_id: str, after: int) -> list[Event]:
        entries = await self.redis.xrange(keys.events(job_id), min=f"0-{after + 1}")
        return [Event.model_validate_json(fields["msg"]) for _, fields in entries]

    async def events(self, job_id: str, after: int = 0) -> AsyncIterator[Event]:
        """Every event of the job with seq > after, each once, ending with the `done` event."""
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(keys.live(job_id))
            # Only once the server confirmed the subscription can the log be read without a gap in between.
            while (await pubsub.get_message(timeout=None))["type"] != "subscribe":
                pass
            last = after
            backlog = await self._log(job_id, last)
            while True:
                for event in backlog:
                    if event.seq != last + 1:
                        continue
                    last = event.seq
                    yield event
                    if event.event is EventKind.done:
                        return
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                if msg is None or msg["type"] != "message":
                    backlog = []
                    continue
                event = Event.model_validate_json(msg["data"])
                # In order: take it. Ahead of what was sent: something was missed, so read the log again.
                backlog = [event] if event.seq <= last + 1 else await self._log(job_id, last)
        finally:
            await pubsub.aclose()
