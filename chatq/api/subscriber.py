"""The API process's one pub/sub connection, which carries the live channels of all its streams: one socket, and
one read brings in the messages of many streams.

Spoken to directly: hiredis parses every reply of a socket read in one call, where redis-py's PubSub costs much
more CPU per message. The connection is redis-py's URL, parsed by it; with a Sentinel URL, each connection goes to
the master the sentinels name at that moment.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import hiredis
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import parse_url

from chatq.core.redis_url import async_sentinel, sentinel_url, ssl_context

log = logging.getLogger(__name__)

# Seconds between two warnings of the same outage.
WARN_INTERVAL = 10.0


def _command(*args: str) -> bytes:
    return hiredis.pack_command(args)  # type: ignore[arg-type]  # the stub types it as a 1-tuple


class Subscriber:
    """Subscribes and unsubscribes channels, hands each message to `on_message(channel, message)`, and
    reconnects (subscribing everything wanted again) whenever the connection breaks."""

    def __init__(self, url: str, on_message: Callable[[str, str], None]):
        where = sentinel_url(url)
        self.options: dict[str, Any] = dict(parse_url(url)) if where is None else where.login
        self._master = None if where is None else (async_sentinel(where), where.master)
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
            # rediss://: verified as redis-py verifies the pool's connections (the URL's ssl_* parameters).
            tls = ssl_context(o) if o.get("connection_class") is aioredis.SSLConnection else None
            host, port = await self._address()
            reader, writer = await asyncio.open_connection(host, port, ssl=tls)
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

    async def _address(self) -> tuple[str, int]:
        if self._master is None:
            return self.options.get("host", "localhost"), self.options.get("port", 6379)
        sentinel, name = self._master
        host, port = await sentinel.discover_master(name)
        return host, int(port)

    async def _run(self) -> None:
        warned_at = -WARN_INTERVAL
        while self._wanted:
            try:
                reader, writer = await self._connect()
            except (OSError, hiredis.ReplyError, redis.RedisError) as e:  # RedisError: no sentinel names a master
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
