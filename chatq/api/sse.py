"""A job's events as a Server-Sent Events response: one frame per event, its id the sequence number."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError

from chatq.api.relay import Relay, ending
from chatq.core.errors import RelayFailed
from chatq.core.settings import Settings

log = logging.getLogger(__name__)


class KeepAlive(ServerSentEvent):
    """The keep-alive of a quiet stream: one comment line and no blank line after it. A blank line ends an event, and
    once a stream has carried an `id:` (every chatq stream does, for resuming) the openai SDK turns an event with no
    data into a crash in json.loads."""

    FRAME = b": keep-alive\n"

    def encode(self) -> bytes:
        return self.FRAME


class EventStream(EventSourceResponse):
    """sse-starlette's response with its send timeout on keep-alives and the stream's end only.

    The timeout's cancel scope costs more than the rest of a relayed frame. A client that stops reading without
    disconnecting stalls every send once its socket's buffers are full, the keep-alives' too, so timing those out
    alone drops such a client at no cost per frame.
    """

    async def _send_with_timeout(self, send: Any, message: Any) -> None:
        if message.get("body") == KeepAlive.FRAME:
            await super()._send_with_timeout(send, message)
        else:
            await send(message)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_end_with_timeout(message: Any) -> None:
            # sse-starlette sends a stream's end without its timeout, holding the lock the keep-alives take: a client
            # stuck as its stream ends would hold both for ever.
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await EventSourceResponse._send_with_timeout(self, send, message)
            else:
                await send(message)

        try:
            await super().__call__(scope, receive, send_end_with_timeout)
        except SendTimeoutError:
            log.warning("a client read nothing of its stream for %s s; it is dropped", self.send_timeout)


def job_stream(
    relay: Relay, job_id: str, after: int, settings: Settings, on_disconnect: Callable[[], None] | None = None
) -> EventStream:
    """The job's events after `after`; `on_disconnect` runs if the client leaves before the end."""
    last = after

    async def frames() -> AsyncGenerator[bytes, None]:
        nonlocal last
        # Events that arrived together leave in one write: a stream that fell behind catches up cheaply.
        async for batch in relay.batches(job_id, after):
            yield b"".join(e.sse_frame() for e in batch)
            last = batch[-1].seq

    def failure() -> bytes:
        return b"".join(e.sse_frame() for e in ending(last, RelayFailed()))

    return event_stream(frames(), settings, failure, on_disconnect, f"job {job_id}")


def event_stream(
    frames: AsyncGenerator[bytes, None],
    settings: Settings,
    failure: Callable[[], bytes],
    on_disconnect: Callable[[], None] | None,
    what: str,
) -> EventStream:
    """An SSE response of `frames`, with the keep-alives and send timeout the settings name. Should relaying them
    fail, the client gets `failure()`, which ends its stream (it is still there, and its job goes on); `on_disconnect`
    runs if the client leaves before the end. `what` names the stream in the log."""
    return EventStream(
        _guarded(frames, failure, on_disconnect, what),
        ping=settings.sse_keepalive,
        ping_message_factory=KeepAlive,
        send_timeout=settings.sse_send_timeout,
        headers={"X-Accel-Buffering": "no"},
    )


async def _guarded(
    frames: AsyncGenerator[bytes, None],
    failure: Callable[[], bytes],
    on_disconnect: Callable[[], None] | None,
    what: str,
) -> AsyncIterator[bytes]:
    finished = False
    try:
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame
        finished = True
    except Exception:
        log.exception("relaying %s failed", what)
        finished = True
        yield failure()
    finally:
        if on_disconnect is not None and not finished:
            on_disconnect()
