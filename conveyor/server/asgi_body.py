"""A request body read ahead of the app that will answer it (a dispatcher reads `model` from it first), then
handed on: the multi-model server's and the cluster router's dispatchers share this."""

from __future__ import annotations

from starlette.types import Message, Receive, Scope

from conveyor.server.errors import APIError
from conveyor.server.limits import too_large

BODY_METHODS = ("POST", "PUT", "PATCH")


async def read_body(scope: Scope, receive: Receive, limit: int | None = None) -> bytes:
    """The whole request body (b"" for a method without one); a 413 past `limit` (None: a cap elsewhere)."""
    if scope["method"] not in BODY_METHODS:
        return b""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(400, "the client disconnected", "invalid_request_error")
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then the connection's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
