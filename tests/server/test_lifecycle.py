"""Graceful shutdown: in-flight requests finish, new ones get 503, the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from conveyor.config import EngineConfig, ServerConfig
from tests.cluster.cluster_harness import free_port


class StreamReader(threading.Thread):
    """Reads one SSE completion stream in the background, noting when each event arrived."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[tuple[float, str]] = []
        self.started_streaming = threading.Event()
        self.status: int | None = None

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json={**self.body, "stream": True},
                          timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append((time.monotonic(), line[6:]))
                    self.started_streaming.set()

    def chunks(self) -> list[dict]:
        return [json.loads(data) for _, data in self.events if data != "[DONE]"]


def _assert_refused_while_draining(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
    assert r.headers["Retry-After"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["status"] == "shutting_down"


def test_sigterm_drains_in_flight_then_exits(serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(shutdown_grace_seconds=30)) as served:
        reader = StreamReader(served.url, {"prompt": "drain me", "max_tokens": 300, "ignore_eos": True,
                                           "stream_options": {"include_usage": True}})
        reader.start()
        assert reader.started_streaming.wait(10)
        drain_started = time.monotonic()
        served.server.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on the real signal
        served.wait_until(lambda: served.app.state.lifecycle.draining, what="draining")
        _assert_refused_while_draining(served.url)

        reader.join(30)
        served.thread.join(15)
        assert not served.thread.is_alive(), "the server did not exit after draining"
    chunks = reader.chunks()
    assert reader.events[-1][0] > drain_started, "the request finished before the drain began"
    assert reader.events[-1][1] == "[DONE]"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    assert served.server._captured_signals == []  # nothing re-raised after shutdown: exit status stays 0


def test_grace_period_expiry_aborts_stragglers(serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(shutdown_grace_seconds=0.5)) as served:
        short = StreamReader(served.url, {"prompt": "short", "max_tokens": 5})
        long = StreamReader(served.url, {"prompt": "long", "max_tokens": 3000, "ignore_eos": True})
        long.start()
        assert long.started_streaming.wait(10)
        short.start()
        assert short.started_streaming.wait(10)
        served.server.request_drain()
        long.join(15)
        short.join(15)
        served.thread.join(15)
        assert not served.thread.is_alive()
        assert served.core.pool.stats().num_used == 0
    assert short.chunks()[-1]["choices"][0]["finish_reason"] == "length"
    assert long.chunks()[-1]["choices"][0]["finish_reason"] == "abort"
    assert len(long.chunks()) < 3000


def test_cli_process_exits_0_on_sigterm(tmp_path):
    """The real entry point with the bundled SmolLM2: SIGTERM mid-request, the request completes, exit 0."""
    port = free_port()  # below the ephemeral range: no outbound connection takes it before the child binds
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")
    env = {**os.environ, "CONVEYOR_SHUTDOWN_GRACE_SECONDS": "30"}
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.server.cli", "--port", str(port), "--parallel", "2",
                             "--ctx-size", "2048"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180  # a first start may build the kernels
        while True:
            assert proc.poll() is None, f"server died: {(tmp_path / 'server.log').read_text()}"
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        reader = StreamReader(url, {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True,
                                    "temperature": 0})
        reader.start()
        assert reader.started_streaming.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        if reader.is_alive():  # still streaming: the server must refuse newcomers meanwhile
            try:
                _assert_refused_while_draining(url)
            except httpx.ConnectError:  # NOTE: the request finished and the server exited in between
                reader.join(5)
                assert not reader.is_alive(), "refused a connection while a request was still draining"
        reader.join(60)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (tmp_path / "server.log").read_text()
    assert reader.chunks()[-1]["choices"][0]["finish_reason"] == "length", output
    assert "draining" in output and "ctx_size" in output  # the effective config was logged
