"""The broker transport workers and Flower connect with: kombu's Redis transport, one client per connection pool."""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis


class _Channel(kombu_redis.Channel):
    """kombu's Redis channel, building one client per connection pool instead of one per call.

    kombu makes a new redis.Redis for each delivery's bookkeeping and each ack, and redis-py spends about 160 us
    building one (its table of reply callbacks): a tenth of a worker's CPU per job. A client is only a handle on
    the pool and safe to share between threads.
    """

    _client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:
            # The channel was closed with its connection (Redis went away). kombu would build a new pool from the
            # missing connection's settings and fail with an AttributeError, which Celery's consumer does not take
            # for a connection error: the worker process died where it should have reconnected. As a connection
            # error it is what it is: the restore of unacknowledged messages on close and the acks of jobs that were
            # running are given up (and logged), as when Redis is unreachable, and the consumer reconnects.
            raise redis.ConnectionError("the broker connection this channel belonged to is closed")
        if asynchronous:
            return super()._create_client(asynchronous=True)
        if self._client is None or self._client.connection_pool is not self.pool:
            self._client = super()._create_client()
        return self._client


class RedisTransport(kombu_redis.Transport):
    Channel = _Channel
