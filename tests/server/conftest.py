"""Real uvicorn servers on free 127.0.0.1 ports, each in a background thread, over a tiny random model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from conveyor.config import EngineConfig, ServerConfig
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.engine import EngineCore
from conveyor.loading import Checkpoint
from conveyor.server import create_app
from conveyor.server.lifecycle import GracefulServer
from conveyor.testing import tiny_checkpoint


@dataclass
class Served:
    url: str
    core: EngineCore
    engine: AsyncEngine
    app: FastAPI
    server: GracefulServer
    thread: threading.Thread

    @property
    def model(self) -> str:
        return self.app.state.serving.model_id

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def wait_until(self, predicate, timeout: float = 120.0, what: str = "condition") -> None:
        # The deadline only ends a hang: the wait returns at the event, however busy the machine.
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)


@contextmanager
def serve(checkpoint: Checkpoint, engine_config: EngineConfig | None = None,
          server_config: ServerConfig | None = None, engine_kwargs: dict | None = None) -> Iterator[Served]:
    core = EngineCore(engine_config or EngineConfig(parallel=4), checkpoint=checkpoint)
    engine = AsyncEngine(core, **(engine_kwargs or {}))
    app = create_app(engine, server_config or ServerConfig(metrics=True))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; uvicorn serves this very socket
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = GracefulServer(config, app.state.lifecycle)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    served = Served(f"http://127.0.0.1:{port}", core, engine, app, server, thread)
    served.wait_until(lambda: server.started or not thread.is_alive(), what="server start")
    assert server.started, "uvicorn failed to start"
    try:
        yield served
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


@pytest.fixture(scope="session")
def tiny() -> Checkpoint:
    return tiny_checkpoint()


@pytest.fixture(scope="session")
def serve_tiny(tiny: Checkpoint):
    """A factory: `with serve_tiny(EngineConfig(...), ServerConfig(...)) as served:` for a dedicated server."""
    def factory(engine_config: EngineConfig | None = None, server_config: ServerConfig | None = None,
                **engine_kwargs):
        return serve(tiny, engine_config, server_config, engine_kwargs)
    return factory


@pytest.fixture(scope="session")
def served(tiny: Checkpoint) -> Iterator[Served]:
    """The shared server: 4 slots, metrics on, no API key. Tests must leave it idle."""
    with serve(tiny, EngineConfig(parallel=4, max_queue_depth=32), ServerConfig(metrics=True)) as s:
        yield s


LONG_STREAM = {"prompt": "Count forever:", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}


class LongStreams:
    """`n` long streaming completions held open in background threads until `close()`."""

    def __init__(self, url: str, n: int, path: str = "/v1/completions", body: dict | None = None,
                 headers: dict | None = None) -> None:
        self.started = [threading.Event() for _ in range(n)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._read, args=(url + path, body or LONG_STREAM, headers or {}, e),
                                          daemon=True) for e in self.started]
        for t in self._threads:
            t.start()

    def _read(self, url: str, body: dict, headers: dict, started: threading.Event) -> None:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                if self._stop.is_set():
                    return  # leaving the block closes the connection: the server aborts the request

    def wait_started(self, timeout: float = 60) -> None:
        for event in self.started:
            assert event.wait(timeout), "a background stream did not start"

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


@pytest.fixture
def long_streams():
    """A factory: `long_streams(url, n)` starts n long streaming completions; all are closed after the test."""
    opened: list[LongStreams] = []

    def start(url: str, n: int, **kwargs) -> LongStreams:
        opened.append(LongStreams(url, n, **kwargs))
        return opened[-1]
    yield start
    for streams in opened:
        streams.close()
