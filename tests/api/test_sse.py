"""The SSE response on its own, with a fake ASGI server in place of a client's socket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from chatq.api.sse import EventStream, KeepAlive


async def forever() -> None:
    await asyncio.Event().wait()


@pytest.mark.timeout(30)
def test_a_client_that_stops_reading_is_dropped_once_a_keep_alive_cannot_be_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> tuple[bool, int]:
        sent: list[bytes] = []
        closed = asyncio.Event()

        async def frames() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: x\n\n"
            finally:
                closed.set()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                sent.append(message["body"])
                if len(sent) >= 3:  # the client's socket buffers are full: no send returns any more
                    await forever()

        async def receive() -> dict[str, Any]:  # the client stays connected
            await forever()
            raise AssertionError

        stream = EventStream(frames(), ping=0.05, ping_message_factory=KeepAlive, send_timeout=0.3)
        await asyncio.wait_for(stream({"type": "http", "method": "GET"}, receive, send), 10)
        return closed.is_set(), len(sent)

    with caplog.at_level(logging.WARNING, logger="chatq.api.sse"):
        closed, sends = asyncio.run(main())
    assert closed  # the relay behind the stream was closed, and so its subscription
    assert sends >= 3
    assert any("read nothing of its stream" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(30)
def test_a_slow_reader_is_not_dropped() -> None:
    async def main() -> list[bytes]:
        async def frames() -> AsyncIterator[bytes]:
            for i in range(5):
                yield b"data: %d\n\n" % i

        sent: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                await asyncio.sleep(0.1)  # each send waits for the client, but well within the timeout
                sent.append(message["body"])

        async def receive() -> dict[str, Any]:
            await forever()
            raise AssertionError

        # A send takes 0.1 s, the timeout is 20 times that: a busy machine's pause does not drop this reader.
        stream = EventStream(frames(), ping=0.05, ping_message_factory=KeepAlive, send_timeout=2)
        await asyncio.wait_for(stream({"type": "http", "method": "GET"}, receive, send), 10)
        return sent

    sent = asyncio.run(main())
    assert [s for s in sent if s.startswith(b"data")] == [b"data: %d\n\n" % i for i in range(5)]


@pytest.mark.timeout(30)
def test_a_client_stuck_as_its_stream_ends_is_dropped_too() -> None:
    async def main() -> None:
        async def frames() -> AsyncIterator[bytes]:
            yield b"data: x\n\n"

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await forever()  # the end of the stream cannot be written out any more

        async def receive() -> dict[str, Any]:
            await forever()
            raise AssertionError

        stream = EventStream(frames(), ping=0.05, ping_message_factory=KeepAlive, send_timeout=0.3)
        await asyncio.wait_for(stream({"type": "http", "method": "GET"}, receive, send), 10)

    asyncio.run(main())
