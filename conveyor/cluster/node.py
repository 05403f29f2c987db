"""What the prefill and decode roles share: a frame server on --serving-bind, probe-tolerant,
bad-frame-proof, that tells the router which models it serves, with the EOF watch that turns a
closed connection into a cancel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Sequence

from conveyor.cluster import transport
from conveyor.cluster.transport import PeerClosed
from conveyor.cluster.wire import WRONG_MODEL, ErrorFrame, Frame, GrammarWire, InfoFrame, LogprobWire, NodeInfoFrame, \
    SamplingWire, WireError
from conveyor.engine.outputs import TokenLogprob
from conveyor.engine.sampling_params import SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.structured.grammar import GrammarSpec

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = tuple(f for f in SamplingWire.__struct_fields__ if f not in ("max_tokens", "grammar"))
_TRANSPORT_ERRORS = (ConnectionError, asyncio.IncompleteReadError, OSError, asyncio.TimeoutError)


class Refusal(Exception):
    """A request turned away before any token: the ErrorFrame to answer with."""

    def __init__(self, frame: ErrorFrame) -> None:
        super().__init__(frame.message)
        self.frame = frame


def refuse(status: int, message: str, code: str, param: str | None = None) -> Refusal:
    return Refusal(ErrorFrame(status=status, message=message, code=code, param=param))


def to_sampling_params(sampling: SamplingWire, max_tokens: int) -> SamplingParams:
    """Raises InvalidRequestError for values the engine refuses."""
    grammar = sampling.grammar
    structured = GrammarSpec(grammar.kind, grammar.source) if grammar is not None else None
    return SamplingParams(max_tokens=max_tokens, structured=structured,
                          **{name: getattr(sampling, name) for name in _SAMPLING_FIELDS})


def to_wire(params: SamplingParams) -> SamplingWire:
    """The request's whole sampling contract: penalties, stops, seed, logprobs, grammar."""
    spec = params.structured
    grammar = GrammarWire(kind=spec.kind, source=spec.source) if spec is not None else None
    return SamplingWire(max_tokens=params.max_tokens, grammar=grammar,
                        **{name: getattr(params, name) for name in _SAMPLING_FIELDS})


async def compile_grammar(core, params: SamplingParams) -> None:
    """Compile the request's grammar (or find it cached) off the event loop, as a node's HTTP path does;
    make_request then starts its matcher from the cache."""
    if params.structured is None:
        return
    try:
        await asyncio.to_thread(core.grammars.compile, params.structured)
    except InvalidRequestError as exc:
        raise refuse(400, str(exc), "invalid_request", exc.param) from None


def image_marker_of(core) -> str | None:
    """The image marker text of an engine's vision model (None: a text model, or no engine)."""
    vision = getattr(core, "vision", None)
    return vision.processor.image_marker if vision is not None else None


def logprobs_to_wire(logprobs: list[TokenLogprob]) -> list[LogprobWire]:
    return [LogprobWire(lp.token_id, lp.logprob, list(lp.top)) for lp in logprobs]


def logprobs_from_wire(logprobs: list[LogprobWire]) -> list[TokenLogprob]:
    return [TokenLogprob(lp.token_id, lp.logprob, [tuple(t) for t in lp.top]) for lp in logprobs]


class FrameServer:
    """Accepts one request frame per connection and hands it to `handle(frame, reader, writer)`; answers
    an InfoFrame itself. `models`: the ids its GET /v1/models lists (empty: unknown, nothing is checked);
    `http_address`: where its own HTTP API listens (None: not said); `image_marker`: its vision model's marker text."""

    role = "node"

    def __init__(self, bind: str, models: Sequence[str] = (), http_address: str | None = None,
                 image_marker: str | None = None) -> None:
        self.bind = bind
        self.models = list(models)
        self.http_address = http_address
        self.image_marker = image_marker  # its model's image marker (None: no tower): the router renders with it
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self.num_bad_frames = 0

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models

    def wrong_model(self, model: str | None) -> Refusal:
        """The refusal of a frame meant for another model: its sender tries a node that serves it."""
        return refuse(404, f"this {self.role} node serves {', '.join(self.models)}, not {model!r}", WRONG_MODEL,
                      "model")

    async def start(self) -> None:
        host, port = transport.parse_address(self.bind)
        self._server = await asyncio.start_server(self._accept, host, port, limit=transport.STREAM_LIMIT)
        logger.info("%s node: role transport listening on %s", self.role, self.bind)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def handle(self, frame: Frame, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            try:
                frame = await transport.read_frame(reader)
            except PeerClosed:
                return  # a health probe: connect, then close
            except WireError as exc:
                self.num_bad_frames += 1
                logger.warning("%s node: rejected a bad frame: %s", self.role, exc)
                await _try_send(writer, ErrorFrame(status=400, message=str(exc), code="bad_frame"))
                return
            except _TRANSPORT_ERRORS:
                return
            if isinstance(frame, InfoFrame):
                await _try_send(writer, NodeInfoFrame(role=self.role, models=self.models,
                                                      http_address=self.http_address, image_marker=self.image_marker))
                return
            try:
                await self.handle(frame, reader, writer)
            except Refusal as refusal:
                await _try_send(writer, refusal.frame)
            except _TRANSPORT_ERRORS:
                pass  # the peer went away; handle() has released what it held
            except Exception as exc:  # a bug must cost one request, never the node
                logger.exception("%s node: request failed", self.role)
                await _try_send(writer, ErrorFrame(status=500, message=f"{self.role} node error: {exc}",
                                                   code="internal"))
        finally:
            transport.close(writer)
            self._tasks.discard(task)


async def _try_send(writer: asyncio.StreamWriter, frame: Frame) -> None:
    with contextlib.suppress(*_TRANSPORT_ERRORS):
        await transport.write_frame(writer, frame)


async def until_closed(reader: asyncio.StreamReader) -> None:
    """Returns when the peer closes (or resets) the connection; nothing more is expected from it."""
    with contextlib.suppress(*_TRANSPORT_ERRORS):
        while await reader.read(65536):
            pass


async def run_unless_closed(work: Awaitable[None], reader: asyncio.StreamReader) -> bool:
    """Run `work` until done, or cancel it when the upstream peer closes first; True if cancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(until_closed(reader))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        cancelled = not task.done()
        if cancelled:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # re-raises handle()'s own errors when it finished first
    return cancelled
