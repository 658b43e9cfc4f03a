"""The broker transports workers and Flower connect with: kombu's Redis transport (and its Sentinel one, which finds
the master through the sentinels), one client per connection pool."""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from chatq.core.queue import PRIORITY_LANES


class _Channel(kombu_redis.Channel):
    """kombu's Redis channel, building one client per connection pool instead of one per call.

    kombu makes a new redis.Redis for each delivery's bookkeeping and each ack, and building one (its table of
    reply callbacks) is a large share of a worker's CPU per job. A client is only a handle on the pool and safe to
    share between threads.
    """

    _client: Any = None
    # kombu clamps a message's priority to 0..9 where it puts one back (a lost worker's): chatq has one lane more.
    max_priority = PRIORITY_LANES - 1

    def _create_client(self, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:
            # Its connection closed (Redis went away). kombu would raise an AttributeError, killing the worker; on
            # a ConnectionError Celery gives up restoring unacked messages and acking running jobs (logged), and
            # reconnects.
            raise redis.ConnectionError("the broker connection this channel belonged to is closed")
        if asynchronous:
            return super()._create_client(asynchronous=True)
        if self._client is None or self._client.connection_pool is not self.pool:
            self._client = super()._create_client()
        return self._client


class _SentinelChannel(_Channel, kombu_redis.SentinelChannel):
    """The same over Sentinel: kombu's SentinelChannel only builds the pool differently (the master's, through the
    sentinels), so the client kept per pool applies as it is."""


class RedisTransport(kombu_redis.Transport):
    Channel = _Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = _SentinelChannel
