"""Two pure-ASGI layers around the routes: a body-size cap and a last-resort 500.

Why not Starlette's `exception_handler(Exception)`: that handler lives in
ServerErrorMiddleware, which sends the 500 and then re-raises; uvicorn, seeing an exception
after a response started, closes the connection, so the client's next request on that
pooled keep-alive connection fails with "connection reset by peer". `CatchAll` answers and
does not re-raise, so the connection stays usable.
"""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.server.errors import APIError
from conveyor.server.limits import too_large

logger = logging.getLogger(__name__)


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once from Content-Length, else when the stream passes it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_error(send, too_large(self.max_bytes), scope["path"])
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)  # an APIError: the route's handler answers 413
            return message

        await self.app(scope, limited_receive, send)


class CatchAll:
    """Any exception that escapes the routes becomes a 500 (in the called API's error shape) on a connection that stays open."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # half a response went out: closing the connection is the only honest end
            await _send_error(send, APIError(500, f"internal server error: {type(exc).__name__}", "server_error",
                                             code="internal_error"), scope["path"])


async def _send_error(send: Send, error: APIError, path: str) -> None:
    body = json.dumps(error.body(path)).encode()  # ensure_ascii: valid whatever the message holds
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
