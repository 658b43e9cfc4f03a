"""The cap on request bodies, applied before a body is read whole."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatq.api.errors import error_response
from chatq.core.errors import RequestTooLarge


class BodyLimit:
    """Answers 413 for a body over `limit` bytes: at once for a Content-Length over it, and for a chunked body as
    soon as the bytes received pass it, without reading the rest.

    A pure ASGI wrapper because neither Starlette nor FastAPI has a body size limit, and a route only sees the body
    once FastAPI has read it whole.
    """

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            # The server holds a body to its Content-Length, so one within the limit needs no counting.
            if not length.isdigit() or int(length) > self.limit:
                return await error_response(RequestTooLarge(self.limit))(scope, receive, send)
            return await self.app(scope, receive, send)
        if b"transfer-encoding" not in headers:  # no body at all
            return await self.app(scope, receive, send)
        await _Counted(self, scope, receive, send).run()


class _Counted:
    """One chunked request: its body counted as it arrives; past the limit, the 413 is sent here, the application
    reads a disconnect and its own answer is dropped."""

    def __init__(self, limit: BodyLimit, scope: Scope, receive: Receive, send: Send):
        self.app, self.limit, self.scope = limit.app, limit.limit, scope
        self._receive, self._send = receive, send
        self.received = 0
        self.refused = self.started = False

    async def run(self) -> None:
        await self.app(self.scope, self.receive, self.send)

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.refused = True
                if not self.started:  # an application answering before reading its body keeps its answer
                    await error_response(RequestTooLarge(self.limit))(self.scope, self._receive, self._send)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.refused and not self.started:
            return
        self.started = True
        await self._send(message)
