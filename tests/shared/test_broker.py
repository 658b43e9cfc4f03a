"""The workers' broker transport: kombu's Redis transport, with one client per connection pool."""

from __future__ import annotations

from kombu import Connection

from shared.broker import RedisTransport
from shared.settings import Settings


def test_one_client_serves_every_delivery_and_ack(settings: Settings) -> None:
    with Connection(settings.redis_url, transport=RedisTransport) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
        assert first.ping()
