"""A multi-model server on a free 127.0.0.1 port, in a background thread, for the tests beside this file."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from conveyor.config import EngineConfig, ModelsConfig, ServerConfig
from conveyor.server.lifecycle import GracefulServer
from conveyor.server.multimodel.app import MultiModelApp
from conveyor.server.multimodel.serve import MultiModelLifecycle, build_multi_model_app

ENGINE = EngineConfig(parallel=2, kv_cache_budget="8M", max_queue_depth=64)


@contextmanager
def serve_multi(models: ModelsConfig, server: ServerConfig | None = None,
                engine: EngineConfig = ENGINE) -> Iterator[tuple[str, MultiModelApp]]:
    """A multi-model server (server/multimodel/) on a free port, in a thread; its URL and app."""
    multi = build_multi_model_app(models, engine, server or ServerConfig(metrics=True))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = GracefulServer(uvicorn.Config(multi, log_level="warning", timeout_graceful_shutdown=2),
                        MultiModelLifecycle(multi, 5.0))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the multi-model server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", multi
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()
