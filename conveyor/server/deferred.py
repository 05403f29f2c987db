"""Listen first, load after: the ASGI app `conveyor serve` runs while the model is still loading.

Until the real app is built (the model loaded, on a worker thread) `/health` answers 503
{"status": "loading", "progress": {...}} and every other route a 503 `loading` error, so load
balancers and people see a server that is coming up rather than a refused connection. The web page
(`/`, `/webui/{name}`), when on, is served already: it shows that progress until the model is ready.
Once built, the real app's lifespan is entered on the server's own loop and every request goes to it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from conveyor.engine.load_progress import LoadProgress
from conveyor.server import errors
from conveyor.server.webui import PageFiles

logger = logging.getLogger(__name__)


class DeferredApp:
    def __init__(self, build: Callable[[LoadProgress], FastAPI], progress: LoadProgress | None = None,
                 on_ready: Callable[[FastAPI], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None, webui: bool = False) -> None:
        self.build = build
        self.progress = progress or LoadProgress()
        self.on_ready = on_ready
        self.on_failure = on_failure
        self.app: FastAPI | None = None
        self.failure: BaseException | None = None
        self._stack = AsyncExitStack()
        self._task: asyncio.Task | None = None
        self._page = PageFiles() if webui else None  # ServerConfig.webui: the page the real app will serve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._loading(scope)(scope, receive, send)
        # a websocket before the app exists: not accepting it closes it

    def _loading(self, scope: Scope) -> Response:
        if self._page is not None and scope["method"] == "GET":
            page = self._page.for_path(scope["path"])
            if page is not None:
                return page
        if scope["path"] == "/health":
            return JSONResponse({"status": "loading", "progress": self.progress.view()}, status_code=503,
                                headers={"Retry-After": "1"})
        return errors.APIError(503, f"the model is loading ({self.progress.stage}); retry shortly", "unavailable",
                               code="loading", headers={"Retry-After": "1"}).response(scope["path"])

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        self._task = asyncio.create_task(self._load())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        if not self._task.done():
            # NOTE: the loading thread cannot be interrupted; the process exits without waiting for it.
            self._task.cancel()
        try:
            await self._stack.aclose()  # the real app's lifespan: engine shutdown
        finally:
            await send({"type": "lifespan.shutdown.complete"})

    async def _load(self) -> None:
        try:
            app = await self._build_in_thread()
            await self._stack.enter_async_context(app.router.lifespan_context(app))
        except Exception as exc:
            self.failure = exc
            logger.error("the model did not load: %s", exc)
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        self.app = app
        if self.on_ready is not None:
            self.on_ready(app)


    def _build_in_thread(self) -> asyncio.Future:
        return on_daemon_thread(lambda: self.build(self.progress), "conveyor-load")


def on_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """fn() on a daemon thread, as a future of the running loop (not the loop's executor, which asyncio.run
    waits for at exit: a server stopped mid-load would hang until the load ends)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the loop, which reports it
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the server stopped meanwhile

    threading.Thread(target=work, name=name, daemon=True).start()
    return future
