"""Graceful shutdown: on SIGTERM/SIGINT stop admitting (503), let in-flight requests finish
within the grace period, abort what is left, then let uvicorn close the sockets and exit 0.
A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from conveyor.engine.async_engine import AsyncEngine
from conveyor.server.openai_serving import OpenAIServing

logger = logging.getLogger(__name__)

POLL_S = 0.05
ABORT_WAIT_S = 2.0  # after the grace period: time for aborted streams to send their last chunk


class Lifecycle:
    def __init__(self, engine: AsyncEngine, serving: OpenAIServing, grace_seconds: float) -> None:
        self.engine = engine
        self.serving = serving
        self.grace_seconds = grace_seconds

    @property
    def draining(self) -> bool:
        return self.serving.draining

    def stop_admitting(self) -> None:
        self.serving.draining = True
        self.engine.accepting = False

    async def drain(self) -> bool:
        """Stop admitting and wait for in-flight requests; True when all finished within the grace period."""
        self.stop_admitting()
        in_flight = len(self.serving.active)
        logger.info("draining: %d request(s) in flight, grace %.1f s", in_flight, self.grace_seconds)
        clean = await self._wait_idle(self.grace_seconds)
        if not clean:
            num = self.serving.abort_all()
            logger.warning("grace period over: aborted %d request(s)", num)
            await self._wait_idle(ABORT_WAIT_S)
        return clean

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.serving.active or self.engine.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains before exiting.

    NOTE: uvicorn's own handler closes the listening socket at once (new clients see connection
    refused, not 503) and re-raises the signal after shutdown, which makes the exit status
    -SIGTERM; we keep the socket open while draining and never re-raise.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle | None) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle  # None while the model loads (server/deferred.py): a signal exits at once
        self.failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def fail(self, exc: BaseException) -> None:
        """The model did not load: stop serving; `conveyor serve` exits 1 with the reason."""
        self.failure = exc
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self._loop is None or self.lifecycle is None:
            logger.warning("second signal: exiting now")
            self.should_exit = self.force_exit = True
            return
        logger.info("received %s: draining before exit", signal.Signals(sig).name)
        self.request_drain()

    def request_drain(self) -> None:
        """Thread- and signal-safe: drain, then exit (what the first SIGTERM does)."""
        assert self._loop is not None, "the server is not running"
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            if self.lifecycle is not None:
                await self.lifecycle.drain()
        finally:
            self.should_exit = True
