"""Progress on long waits: the server listens while the model loads (/health 503 "loading" with the
progress, the web page already served), the weights' progress is counted and logged, and a first kernel
build says what it waits for."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from conveyor.config import EngineConfig, ServerConfig, add_flags, load_configs
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.load_progress import LoadProgress
from conveyor.kernels import build as kernel_build
from conveyor.loading import LoadError
from conveyor.server import create_app
from conveyor.server.cli import build_server
from conveyor.server.deferred import DeferredApp
from conveyor.server.lifecycle import GracefulServer
from conveyor.server.webui import load_assets


class GatedWeights(dict):
    """The checkpoint's tensors; taking the `stop_at`-th one blocks until `gate` is set (a slow disk)."""

    def __init__(self, weights: dict, stop_at: int) -> None:
        super().__init__(weights)
        self.stop_at, self.taken = stop_at, 0
        self.reached, self.gate = threading.Event(), threading.Event()

    def __getitem__(self, name):
        self.taken += 1
        if self.taken == self.stop_at:
            self.reached.set()
            assert self.gate.wait(120), "the test never opened the gate"
        return super().__getitem__(name)


class DeferredServer:
    """`conveyor serve`'s wiring (server/cli.py build_server) over a given build, on a free port in a thread."""

    def __init__(self, build, webui: bool = False) -> None:
        self.deferred = DeferredApp(build, LoadProgress(show_bar=False), webui=webui)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = GracefulServer(uvicorn.Config(self.deferred, log_level="warning", timeout_graceful_shutdown=2),
                                     None)
        self.deferred.on_ready = lambda app: setattr(self.server, "lifecycle", app.state.lifecycle)
        self.deferred.on_failure = self.server.fail
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive():
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while self.deferred.app is None:
            assert time.monotonic() < deadline and self.deferred.failure is None, "the server never became ready"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def test_health_answers_loading_with_progress_while_the_model_loads(tiny, caplog):
    caplog.set_level(logging.INFO, logger="conveyor.engine.load_progress")
    weights = GatedWeights(tiny.weights, stop_at=5)
    checkpoint = dataclasses.replace(tiny, weights=weights)

    def build(progress):
        return create_app(AsyncEngine.from_config(EngineConfig(parallel=2), checkpoint, progress=progress),
                          ServerConfig())

    served = DeferredServer(build)
    try:
        assert weights.reached.wait(120), "the load never reached the gate"
        health = httpx.get(f"{served.url}/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        body = health.json()
        assert body["status"] == "loading"
        progress = body["progress"]
        assert progress["stage"] == "weights" and progress["tensors_total"] == len(tiny.weights)
        assert 0 < progress["tensors"] < progress["tensors_total"]
        assert 0 < progress["bytes"] < progress["bytes_total"] and 0 < progress["fraction"] < 1
        refused = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading"
        weights.gate.set()
        deadline = time.monotonic() + 120
        while httpx.get(f"{served.url}/health").status_code != 200:
            assert time.monotonic() < deadline and served.deferred.failure is None, "the server never became ready"
            time.sleep(0.05)
        done = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
        assert served.server.lifecycle is not None  # a signal now drains instead of exiting at once
    finally:
        weights.gate.set()
        served.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "conveyor.engine.load_progress"]
    assert any(line.startswith("loading weights: ") and "tensors" in line for line in lines), lines
    assert "loading: ready" in lines


def gated_build(checkpoint, server_config: ServerConfig):
    """A build that waits for the returned gate before loading `checkpoint`: a load the test ends."""
    gate = threading.Event()

    def build(progress):
        progress.set_stage("reading the checkpoint")
        assert gate.wait(120), "the test never opened the gate"
        return create_app(AsyncEngine.from_config(EngineConfig(parallel=2), checkpoint, progress=progress),
                          server_config)

    return build, gate


PAGE_HEADERS = ("content-type", "content-security-policy", "cache-control", "x-content-type-options")


def test_the_page_is_served_while_the_model_loads_and_the_api_is_not(tiny):
    build, gate = gated_build(tiny, ServerConfig())
    served = DeferredServer(build, webui=True)
    assets = load_assets()
    try:
        page = httpx.get(f"{served.url}/")
        assert page.status_code == 200 and page.content == assets["index.html"]
        assert page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for name, kind in (("webui.js", "text/javascript"), ("webui.css", "text/css")):
            asset = httpx.get(f"{served.url}/webui/{name}")
            assert asset.status_code == 200 and asset.content == assets[name]
            assert asset.headers["content-type"].startswith(kind)
            assert asset.headers["x-content-type-options"] == "nosniff"
        assert httpx.get(f"{served.url}/webui/secret.py").status_code == 404
        health = httpx.get(f"{served.url}/health")
        assert health.status_code == 503 and health.json()["progress"]["stage"] == "reading the checkpoint"
        for refused in (httpx.get(f"{served.url}/v1/models"), httpx.get(f"{served.url}/v1/dashboard"),
                        httpx.post(f"{served.url}/v1/chat/completions", json={"messages": []}),
                        httpx.post(f"{served.url}/")):  # the page is a GET only, as in the real app
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading", refused.request.url
        gate.set()
        served.wait_ready()
        ready = httpx.get(f"{served.url}/")  # now the real app's route: the same file, the same headers
        assert ready.content == page.content
        assert {h: ready.headers[h] for h in PAGE_HEADERS} == {h: page.headers[h] for h in PAGE_HEADERS}
        assert httpx.get(f"{served.url}/v1/models").status_code == 200
    finally:
        gate.set()
        served.stop()


def test_with_the_page_off_it_is_not_served_while_loading_either(tiny):
    build, gate = gated_build(tiny, ServerConfig(webui=False))
    served = DeferredServer(build, webui=False)
    try:
        for path in ("/", "/webui/webui.js"):
            refused = httpx.get(f"{served.url}{path}")
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading"
        gate.set()
        served.wait_ready()
        assert httpx.get(f"{served.url}/").status_code == 404  # the real app has no page either
    finally:
        gate.set()
        served.stop()


@pytest.mark.parametrize(("flags", "status"), [([], 200), (["--no-webui"], 503)])
def test_serve_tells_the_loading_app_whether_the_page_is_on(flags, status):
    """`conveyor serve`'s own wiring (build_server), asked before any load starts (no lifespan)."""
    parser = argparse.ArgumentParser()
    add_flags(parser)
    engine_config, server_config = load_configs(parser.parse_args(["--model", "/nowhere", *flags]))
    deferred = build_server(engine_config, server_config).config.app

    async def get_page() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=deferred), base_url="http://test") as client:
            return await client.get("/")

    assert asyncio.run(get_page()).status_code == status


def test_a_model_that_does_not_load_stops_the_server_with_the_reason():
    def build(progress):
        progress.set_stage("reading the checkpoint")
        raise LoadError("model path not found: /nowhere")

    served = DeferredServer(build)
    served.thread.join(timeout=30)
    assert not served.thread.is_alive(), "the server kept running without a model"
    assert isinstance(served.server.failure, LoadError)
    served.sock.close()


def test_load_progress_counts_each_tensor_once_and_logs_every_tenth(caplog):
    caplog.set_level(logging.INFO, logger="conveyor.engine.load_progress")
    weights = {f"w{i}": torch.zeros(10, dtype=torch.float32) for i in range(20)}  # 40 bytes each
    progress = LoadProgress(show_bar=False)
    tracked = progress.track(weights)
    for name in list(tracked) + ["w0", "w1"]:  # a second read (a tied weight) is not progress
        tracked[name]
    view = progress.view()
    assert (view["tensors"], view["tensors_total"], view["bytes"], view["bytes_total"]) == (20, 20, 800, 800)
    assert view["fraction"] == 1.0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading weights:")]
    assert len(lines) == 10 and lines[-1].endswith("(100%)")


def test_first_kernel_build_is_announced(tmp_path, monkeypatch, caplog):
    """Nothing is compiled: an empty extensions directory is what a first start sees."""
    if not kernel_build.is_x86():
        pytest.skip("the announced level is an x86 level")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="conveyor.kernels.build")
    pending = kernel_build._announce_build("x86-64-v3")
    assert pending == set(kernel_build.KERNELS)
    (message,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")]
    assert "for avx2 (-march=x86-64-v3)" in message and str(tmp_path) in message and " s on " in message


@pytest.mark.parametrize(("features", "level"), [
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx"),
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "avx512_bf16"),
    ({"avx2", "fma", "avx512f"}, "avx512"),
    ({"avx2", "fma"}, "avx2"),
    ({"sse4_2"}, "generic"),
])
def test_isa_level_names(features, level):
    assert kernel_build.isa_level(frozenset(features)) == level
