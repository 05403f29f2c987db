"""A real uvicorn server on a free 127.0.0.1 port in a background thread (scripts: fuzz, soak; tests)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from conveyor.config import EngineConfig, ServerConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.engine import EngineCore
from conveyor.loading import Checkpoint


@contextmanager
def serve_in_thread(engine_config: EngineConfig, server_config: ServerConfig,
                    checkpoint: Checkpoint | None = None) -> Iterator[tuple[str, EngineCore]]:
    """Yields (base url, engine core); the server stops on exit."""
    from conveyor.server import create_app

    core = EngineCore(engine_config, checkpoint=checkpoint)
    app = create_app(AsyncEngine(core), server_config)
    with serve_app_in_thread(app, app.state.lifecycle) as url:
        yield url, core


@contextmanager
def serve_app_in_thread(app: Any, lifecycle: Any) -> Iterator[str]:
    """Any of our ASGI apps (a node's, a multi-model front) with its drain lifecycle; yields the base url."""
    from conveyor.server.lifecycle import GracefulServer

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; uvicorn serves this very socket
    server = GracefulServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2), lifecycle)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-bg", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)  # uvicorn sets no event for its start: polled, the deadline only ends a hang
    if not server.started:
        raise RuntimeError("uvicorn failed to start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
