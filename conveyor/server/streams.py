"""A group of engine requests answered as one HTTP response (n choices, or a batch of prompts).

Admission is all-or-nothing and synchronous, so a full queue is answered with 503 before any
response byte is sent. `close()` is synchronous too: it can run from a generator's `finally`
while the task is being cancelled (client gone) without awaiting anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.request import Request
from conveyor.server.metrics import RequestTiming, ServerMetrics


class RequestGroup:
    def __init__(self, engine: AsyncEngine, requests: list[Request], metrics: ServerMetrics, arrival: float,
                 on_close: Callable[[RequestGroup], None] | None = None) -> None:
        self.engine = engine
        self.request_ids = [r.request_id for r in requests]
        self.metrics = metrics
        self._on_close = on_close
        self._unfinished: set[str] = set()
        self._timings: list[RequestTiming] = []
        self._pumps: list[asyncio.Task] = []
        streams = []
        try:
            for request in requests:
                streams.append(engine.submit(request))  # QueueFullError / EngineDeadError
                self._unfinished.add(request.request_id)
                self._timings.append(RequestTiming(arrival))
        except Exception:
            self.close()  # nothing half-admitted stays in the engine
            raise
        self._merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: asyncio.Queue[RequestOutput]) -> None:
        while True:
            out = await stream.get()
            self._merged.put_nowait((index, out))
            if out.finished:
                return

    @property
    def done(self) -> bool:
        return not self._unfinished

    async def next(self) -> tuple[int, RequestOutput]:
        """The next delta of any member, as (member index, output). Only call while not `done`."""
        index, out = await self._merged.get()
        self.metrics.observe(self._timings[index], out)
        if out.finished:
            self._unfinished.discard(out.request_id)
            if self.done:
                self.close()
        return index, out

    def abort(self) -> None:
        """Ask the engine to end unfinished members; their final ("abort") outputs still arrive."""
        for request_id in self._unfinished:
            self.engine.abort(request_id)

    def close(self) -> None:
        """Stop listening and abort whatever is unfinished (its KV blocks are freed by the next tick)."""
        for pump in self._pumps:
            pump.cancel()
        self.abort()
        self._unfinished.clear()
        if self._on_close is not None:
            self._on_close(self)
            self._on_close = None


async def wait_for_disconnect(receive: Callable) -> None:
    """Returns when the client goes away; for use once the request body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass
