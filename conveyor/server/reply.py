"""A group's engine deltas -> the OpenAI response, JSON or SSE.

One code path for a node (a RequestGroup over its own engine, server/streams.py) and the cluster
router (a RemoteGroup over prefill and decode nodes, cluster/router.py): the same chunks, the same
reply parsing (content / reasoning_content / tool_calls), the same logprobs and usage.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from conveyor.engine.outputs import RequestOutput
from conveyor.server import errors
from conveyor.server.responses import (ChoiceState, ResponseHeader, TokenText, chunk, full_response, sse,
                                       tool_finish_reason, usage_chunk)
from conveyor.server.streams import wait_for_disconnect
from conveyor.structured.output import ChatDelta, ChatParsing

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; nobody reads it


class DeltaGroup(Protocol):
    """The requests of one HTTP response (n choices per prompt), merged into one stream of deltas."""

    request_ids: list[str]

    @property
    def done(self) -> bool: ...

    async def next(self) -> tuple[int, RequestOutput]:
        """The next delta of any member, as (choice index, output). Only called while not `done`."""

    def close(self) -> None:
        """Stop listening; end whatever is unfinished. Synchronous and idempotent."""


class SSEResponse(StreamingResponse):
    """A stream that always closes its generator, so a vanished client aborts its requests at once."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # NOTE: when a disconnect cancels us during send(), the generator is parked at a yield
            # and would only be finalized by the garbage collector; close it now instead.
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def respond(http: HTTPRequest, group: DeltaGroup, header: ResponseHeader, token_text: TokenText,
                  stream: bool, include_usage: bool, n: int) -> Response:
    """SSE at once (the group already holds every first token), or the JSON response once all finished."""
    if stream:
        return SSEResponse(stream_reply(group, header, token_text, include_usage, n))
    return await complete(http, group, header, token_text, n)


async def complete(http: HTTPRequest, group: DeltaGroup, header: ResponseHeader, token_text: TokenText,
                   n: int) -> Response:
    choices = await collect_choices(http, group)
    if choices is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(full_response(header, choices, token_text, n))


async def collect_choices(http: HTTPRequest, group: DeltaGroup) -> list[ChoiceState] | None:
    """Every choice's whole output (a non-streamed reply, any API); None when the client left first
    (the group is closed at once). A choice that failed raises the 500 its API answers with."""
    collect = asyncio.create_task(_collect(group))
    gone = asyncio.create_task(wait_for_disconnect(http.receive))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        client_left = not collect.done()  # (or this handler was cancelled)
        if client_left:
            collect.cancel()
            group.close()  # frees the KV blocks now, not when the cancellation lands
    if client_left:
        return None
    choices = collect.result()
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        raise errors.generation_failed(failed.error or "generation failed")
    return choices


async def parsed_deltas(group: DeltaGroup, parsing: ChatParsing | None) -> AsyncIterator[tuple[ChatDelta,
                                                                                                RequestOutput]]:
    """A one-choice group's deltas, each with its reply parsed (content / reasoning / tool calls) as it
    streams; the last one also carries what the parser held back. The Messages and Responses streams
    are written from these. The caller closes the group (its generator's finally)."""
    parser = parsing.parser() if parsing is not None and parsing.enabled else None
    while not group.done:
        _, out = await group.next()
        if parser is None:
            delta = ChatDelta(content=out.new_text)
        else:
            delta = parser.feed(out.new_text)
            if out.finished:
                delta += parser.finish(truncated=out.finish_reason == "length")
        yield delta, out


async def _collect(group: DeltaGroup) -> list[ChoiceState]:
    choices = [ChoiceState(i) for i in range(len(group.request_ids))]
    while not group.done:
        index, out = await group.next()
        choices[index].add(out)
    return choices


async def stream_reply(group: DeltaGroup, header: ResponseHeader, token_text: TokenText, include_usage: bool,
                       n: int) -> AsyncIterator[str]:
    choices = [ChoiceState(i) for i in range(len(group.request_ids))]
    offsets = [0] * len(choices)  # text_offset of each completion choice's next token
    try:
        if header.chat:
            for c in choices:
                yield sse(chunk(header, c.index, "", [], token_text, role=True, with_usage=include_usage))
        parsers = [header.parsing.parser() for _ in choices] if header.parses else None  # type: ignore[union-attr]
        while not group.done:
            index, out = await group.next()
            choices[index].add(out, keep=False)
            parsed, finish_reason, first_tool = None, out.finish_reason if out.finished else None, 0
            if parsers is not None:
                first_tool = parsers[index].num_tool_calls
                parsed = parsers[index].feed(out.new_text)
                if out.finished:
                    parsed += parsers[index].finish(truncated=out.finish_reason == "length")
                    if parsers[index].num_tool_calls:
                        finish_reason = tool_finish_reason(finish_reason)
                if parsed.is_empty and not (out.logprobs or out.finished):
                    continue
            elif not (out.new_text or out.logprobs or out.finished):
                continue  # text held back (stop-string prefix or half a character)
            payload = chunk(header, index, out.new_text, out.logprobs, token_text,
                            finish_reason=finish_reason, offset=offsets[index],
                            with_usage=include_usage, parsed=parsed, first_tool_index=first_tool)
            offsets[index] += sum(len(token_text(lp.token_id)[0]) for lp in out.logprobs)
            if out.finish_reason == "error":
                payload["error"] = errors.generation_failed(out.error or "generation failed").body()["error"]
            yield sse(payload)
        if include_usage:
            yield sse(usage_chunk(header, choices, n))
        yield sse("[DONE]")
    finally:
        group.close()
