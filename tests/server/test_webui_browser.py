"""The page at / in a real browser: Debian's chromium driven by Playwright (no browser download).

Skips, saying why, only where no chromium is installed (`make setup` installs it with apt-get).
Every wait is on a page or server condition, never a sleep. CONVEYOR_WEBUI_SCREENSHOT=path.png
saves the page under load (docs/webui.png is made that way).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from conveyor.config import EngineConfig, ModelsConfig, ServerConfig

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")

# The real binary first: /usr/bin/chromium is Debian's shell wrapper around it.
CHROMIUM = next((p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium"), shutil.which("chromium-browser"))
                 if p and os.access(p, os.X_OK)), None)
if CHROMIUM is None:
    pytest.skip("no chromium browser on this machine (apt-get install chromium; `make setup` tries it): "
                "the web page's browser test cannot run", allow_module_level=True)

WAIT_MS = 60_000  # an upper bound on waiting for an event, never a pacing delay


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def served8(serve_tiny):
    with serve_tiny(EngineConfig(parallel=8, max_queue_depth=32), ServerConfig(metrics=True)) as served:
        yield served


class Page:
    """A browser tab on the server's page, collecting console errors and uncaught exceptions."""

    def __init__(self, browser, url: str) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.page.set_default_timeout(WAIT_MS)
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def wait_live(self) -> None:
        self.page.wait_for_selector('#conn[data-state="live"]')

    def settings(self, **values) -> None:
        self.page.click("#settings summary")
        for name, value in values.items():
            if isinstance(value, bool):
                self.page.set_checked(f"#{name}", value)
            else:
                self.page.fill(f"#{name}", str(value))

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.click("#send")

    def close(self) -> None:
        self.page.close()


def _aborted(served) -> int:
    return served.core.scheduler.stats.finished_by_reason.get("abort", 0)


def test_page_loads_and_a_chat_streams_to_completion(browser, served8):
    tab = Page(browser, served8.url)
    try:
        tab.wait_live()
        tab.page.wait_for_function("(m) => document.querySelector('#model').textContent === m", arg=served8.model)
        # the kernel backend, from the first snapshot (the model's name may come first, from /v1/models)
        tab.page.wait_for_function("() => document.querySelector('#backend').textContent !== ''")
        assert not tab.page.is_visible("#key-form")  # no key needed, none asked for
        assert not tab.page.is_visible("#model-picker")  # one model: nothing to choose
        tab.settings(temperature=0, max_tokens=12)
        tab.send("Hello there!")
        reply = tab.page.wait_for_selector('.msg.assistant[data-state="done"]')
        assert reply.query_selector(".content").text_content()
        meta = reply.query_selector(".meta").text_content()
        assert "finished:" in meta and "tokens" in meta
        assert not tab.errors, tab.errors
    finally:
        tab.close()


def test_stop_button_cancels_and_frees_kv_blocks(browser, served8):
    aborted = _aborted(served8)
    tab = Page(browser, served8.url)
    try:
        tab.wait_live()
        tab.settings(max_tokens=3000, ignore_eos=True)
        tab.send("Count forever")
        # Streaming: text arrived and the request holds KV blocks.
        tab.page.wait_for_function(
            "() => document.querySelector('.msg.assistant .content')?.textContent.length > 0")
        assert served8.core.pool.stats().num_used > 0
        tab.page.click("#stop")
        tab.page.wait_for_selector('.msg.assistant[data-state="stopped"]')
        served8.wait_until(lambda: served8.core.pool.stats().num_used == 0 and served8.engine.num_in_flight == 0,
                           timeout=30, what="the stopped request's KV blocks to be freed")
        assert _aborted(served8) == aborted + 1
        assert tab.page.is_enabled("#send") and not tab.page.is_enabled("#stop")
        assert not tab.errors, tab.errors
    finally:
        tab.close()


def test_dashboard_shows_eight_active_slots_under_load(browser, served8, long_streams):
    tab = Page(browser, served8.url)
    streams = long_streams(served8.url, 8)
    try:
        tab.wait_live()
        tab.page.wait_for_function("() => document.querySelectorAll('#slots tbody tr.active').length === 8")
        assert tab.page.text_content("#stat-running") == "8 / 8"
        # The rows' tokens and rates move: a decoding row shows its tok/s once it has two tokens.
        tab.page.wait_for_function(
            "() => [...document.querySelectorAll('#slots tr[data-state=decoding] td:last-child')]"
            ".filter(td => td.textContent !== '–').length === 8")
        tab.page.wait_for_function("() => Number(document.querySelector('#kv-bar').dataset.used) > 0")
        if path := os.environ.get("CONVEYOR_WEBUI_SCREENSHOT"):
            tab.send("Tell me about continuous batching.")
            tab.page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 40")
            tab.page.screenshot(path=path)
        assert not tab.errors, tab.errors
    finally:
        streams.close()
        tab.close()
    served8.wait_until(lambda: served8.core.pool.stats().num_used == 0 and served8.engine.num_in_flight == 0,
                       timeout=30, what="the background requests to end")


def test_page_asks_for_the_api_key(browser, serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(api_key="sesame")) as served:
        tab = Page(browser, served.url)
        try:
            tab.page.wait_for_selector("#key-form", state="visible")
            tab.page.fill("#api-key", "sesame")
            tab.page.click("#save-key")
            tab.wait_live()
            assert not tab.page.is_visible("#key-form")
            tab.settings(temperature=0, max_tokens=4)
            tab.send("Hi")
            tab.page.wait_for_selector('.msg.assistant[data-state="done"]')
            # The only errors are the browser's notes of the first, keyless 401s.
            assert all("401" in e for e in tab.errors), tab.errors
        finally:
            tab.close()


def test_router_page_shows_each_node(browser):
    """The cluster router serves the same page; its dashboard lists the nodes of both pools."""
    from conveyor.cluster.router import create_router_app
    from conveyor.config import ClusterConfig
    from conveyor.server.lifecycle import GracefulServer
    from conveyor.testing import smollm_tokenizer

    with socket.socket() as node, socket.socket() as dead, socket.socket() as front:
        node.bind(("127.0.0.1", 0))
        node.listen()  # accepts the health probe: online
        dead.bind(("127.0.0.1", 0))  # refuses: unreachable
        front.bind(("127.0.0.1", 0))
        online, offline = (f"127.0.0.1:{s.getsockname()[1]}" for s in (node, dead))
        cluster = ClusterConfig(node_role="router", prefill_peers=online, decode_peers=offline, health_check_interval=60)
        app = create_router_app(smollm_tokenizer(), "tiny-router", cluster)
        server = GracefulServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1), None)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [front]}, daemon=True)
        thread.start()
        tab = None
        try:
            while not server.started:
                assert thread.is_alive(), "the router did not start"
                time.sleep(0.01)  # polling uvicorn start, as conftest.serve does
            tab = Page(browser, f"http://127.0.0.1:{front.getsockname()[1]}")
            tab.wait_live()
            tab.page.wait_for_function("() => document.querySelectorAll('#nodes tbody tr').length === 2")
            assert tab.page.get_attribute("body", "data-role") == "router"
            rows = [r.split("\t") for r in tab.page.eval_on_selector_all(
                "#nodes tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent).join('\\t'))")]
            assert [r[:3] for r in rows] == [["prefill", online, "online"], ["decode", offline, "unreachable"]]
            assert not tab.page.is_visible("#slots")
            assert not tab.errors, tab.errors
        finally:
            if tab is not None:
                tab.close()
            server.should_exit = True
            thread.join(timeout=15)


def test_reasoning_is_folded_and_tool_calls_are_shown(browser, served8):
    """The tiny random model never thinks or calls tools, so this reply is canned (the page's
    request is answered in the browser); what is checked is how the page shows such a stream."""
    def chunk(delta: dict, finish: str | None = None) -> str:
        body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n"

    stream = "".join([
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "The user wants "}), chunk({"reasoning_content": "the weather."}),
        chunk({"content": "Let me check."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "tool_calls"),
        "data: [DONE]\n\n"])
    tab = Page(browser, served8.url)
    try:
        tab.wait_live()
        tab.page.route("**/v1/chat/completions",
                       lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream))
        tab.send("Weather in Paris?")
        reply = tab.page.wait_for_selector('.msg.assistant[data-state="done"]')
        details = reply.query_selector("details.reasoning")
        assert details.get_attribute("open") is None  # folded
        assert details.query_selector("pre").text_content() == "The user wants the weather."
        assert not details.query_selector("pre").is_visible()
        assert reply.query_selector(".content").text_content() == "Let me check."
        assert reply.query_selector(".tool").text_content() == 'tool call: get_weather({"city": "Paris"})'
        assert "finished: tool_calls" in reply.query_selector(".meta").text_content()
        assert not tab.errors, tab.errors
    finally:
        tab.close()


@contextmanager
def _serve_multi_model(models_dir: str) -> Iterator[str]:
    """A multi-model server over every model in models_dir, on a free port; its URL."""
    from conveyor.server.lifecycle import GracefulServer
    from conveyor.server.multimodel.serve import build_multi_model_app

    multi = build_multi_model_app(ModelsConfig(models_dir=models_dir), EngineConfig(parallel=2, kv_cache_budget="8M"),
                                  ServerConfig())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        server = GracefulServer(uvicorn.Config(multi, log_level="warning", timeout_graceful_shutdown=2), None)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            while not server.started:
                assert thread.is_alive(), "the multi-model server did not start"
                time.sleep(0.01)  # polling uvicorn start, as conftest.serve does
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(timeout=30)


def _streamed_reply(url: str, model: str, prompt: str, max_tokens: int) -> str:
    """The greedy reply the page's request gets, streamed as the page streams it."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "temperature": 0, "max_tokens": max_tokens}
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def _picker_options(tab: Page) -> list[str]:
    return tab.page.eval_on_selector_all("#model-select option", "options => options.map(o => o.textContent)")


def test_model_picker_lists_the_models_and_chats_with_the_chosen_one(browser, tmp_path):
    """Two tiny models of different seeds: the page lists both with their state, the second one chosen
    answers the chat (its own greedy reply, loaded on that request alone), and the dashboard follows the choice."""
    from conveyor.testing import write_tiny_model_dir

    for seed, name in enumerate(("alpha", "beta")):
        write_tiny_model_dir(tmp_path / name, seed=seed)
    with _serve_multi_model(str(tmp_path)) as url:
        tab = Page(browser, url)
        chats = []  # the chat request bodies, as the browser sent them
        tab.page.on("request", lambda r: chats.append(json.loads(r.post_data))
                    if r.url.endswith("/v1/chat/completions") else None)
        try:
            tab.page.wait_for_selector("#model-picker", state="visible")
            assert _picker_options(tab) == ["alpha — unloaded", "beta — unloaded"]
            # Watching a model would load it: with none loaded the dashboard waits.
            assert tab.page.get_attribute("#conn", "data-state") == "waiting"
            tab.page.select_option("#model-select", "beta")
            tab.settings(temperature=0, max_tokens=8)
            tab.send("Hello there!")
            reply = tab.page.wait_for_selector('.msg.assistant[data-state="done"]')
            assert [c["model"] for c in chats] == ["beta"]
            assert "beta" in reply.query_selector(".meta").text_content()
            # The reply loaded beta alone; the dashboard now streams beta's snapshots.
            tab.wait_live()
            tab.page.wait_for_function("() => document.querySelector('#model').textContent === 'beta'")
            # the picker's states come from /v1/models (fetched after each reply and every 3 s): wait for them
            tab.page.wait_for_function("(want) => Array.from(document.querySelectorAll('#model-select option'))"
                                       ".map(o => o.textContent).join('|') === want",
                                       arg="alpha — unloaded|beta — loaded")

            want = {name: _streamed_reply(url, name, "Hello there!", 8) for name in ("alpha", "beta")}
            assert want["alpha"] != want["beta"]  # so the reply tells the models apart
            assert reply.query_selector(".content").text_content() == want["beta"]

            with tab.page.expect_request(lambda r: r.url.endswith("/v1/dashboard/stream?model=alpha")):
                tab.page.select_option("#model-select", "alpha")
            tab.page.wait_for_function("() => document.querySelector('#model').textContent === 'alpha'")
            tab.wait_live()
            assert not tab.errors, tab.errors
        finally:
            tab.close()


def test_a_page_opened_while_the_model_loads_shows_the_progress_then_the_page(browser, tiny):
    """`conveyor serve` listens before its model is loaded: the page shows the stage, the download's and
    the weights' bars and the time spent, then, once the model is ready, the page as ever (a chat works)."""
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.server import create_app
    from tests.server.test_loading import DeferredServer, GatedWeights

    weights = GatedWeights(tiny.weights, stop_at=5)  # the load blocks at the 5th tensor until the gate opens
    checkpoint = dataclasses.replace(tiny, weights=weights)

    def build(progress):
        progress.download(2_000_000, 2_000_000)  # a finished Hub download, as loading/hub.py reports one
        return create_app(AsyncEngine.from_config(EngineConfig(parallel=2), checkpoint, progress=progress),
                          ServerConfig())

    served = DeferredServer(build, webui=True)
    tab = None
    try:
        assert weights.reached.wait(120), "the load never reached the gate"
        tab = Page(browser, served.url)
        tab.page.wait_for_function("() => document.querySelector('#load-stage').textContent === 'stage: weights'")
        assert tab.page.is_visible("#loading") and not tab.page.is_visible("main")
        assert tab.page.get_attribute("#conn", "data-state") == "loading"
        assert tab.page.text_content("#load-download-text") == "2.0 of 2.0 MB (100%)"
        assert tab.page.eval_on_selector("#load-download-bar", "bar => bar.value") == 1
        assert 0 < tab.page.eval_on_selector("#load-weights-bar", "bar => bar.value") < 1
        assert tab.page.text_content("#load-weights-text").endswith(f"/{len(tiny.weights)} tensors")
        assert tab.page.text_content("#load-elapsed").endswith(" s elapsed")
        weights.gate.set()
        tab.wait_live()
        model = served.deferred.app.state.serving.model_id
        tab.page.wait_for_function("(m) => document.querySelector('#model').textContent === m", arg=model)
        assert not tab.page.is_visible("#loading") and tab.page.is_visible("main")
        tab.settings(temperature=0, max_tokens=4)
        tab.send("Hi")
        tab.page.wait_for_selector('.msg.assistant[data-state="done"]')
        # The only errors are the browser's notes of /health's 503s while loading.
        assert all("503" in e for e in tab.errors), tab.errors
    finally:
        weights.gate.set()
        if tab is not None:
            tab.close()
        served.stop()


def test_a_page_waiting_on_a_load_that_fails_says_the_server_went_away(browser):
    """A model that does not load stops the server (server/deferred.py): the page says so instead of waiting."""
    from conveyor.loading import LoadError
    from tests.server.test_loading import DeferredServer

    gate = threading.Event()

    def build(progress):
        progress.set_stage("reading the checkpoint")
        assert gate.wait(120), "the test never opened the gate"
        raise LoadError("model path not found: /nowhere")

    served = DeferredServer(build, webui=True)
    tab = None
    try:
        tab = Page(browser, served.url)
        tab.page.wait_for_function(
            "() => document.querySelector('#load-stage').textContent === 'stage: reading the checkpoint'")
        gate.set()
        tab.page.wait_for_selector('#loading[data-state="gone"]')
        assert "went away" in tab.page.text_content("#load-title")
        assert tab.page.get_attribute("#conn", "data-state") == "gone"
        served.thread.join(timeout=30)
        assert not served.thread.is_alive()
        assert all("503" in e or "ERR_CONNECTION_REFUSED" in e for e in tab.errors), tab.errors
    finally:
        gate.set()
        if tab is not None:
            tab.close()
        served.stop()


# -- images ------------------------------------------------------------------------------------------------------
_PASTE = """([b64, name]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], name, { type: "image/png" }));
  document.querySelector("#prompt").dispatchEvent(new ClipboardEvent("paste", { clipboardData: data, bubbles: true }));
}"""


def test_a_picked_image_to_a_text_model_shows_the_400_and_leaves_the_conversation(browser, served8):
    from tests.multimodal.image_files import png

    tab = Page(browser, served8.url)
    try:
        tab.wait_live()
        tab.settings(temperature=0, max_tokens=4)
        tab.page.set_input_files("#image-file", files=[{"name": "a.png", "mimeType": "image/png", "buffer": png(1)}])
        tab.page.wait_for_selector("#attachments img.thumb")
        tab.send("What is this?")
        failed = tab.page.wait_for_selector('.msg.assistant[data-state="error"]')
        assert "does not accept images" in failed.query_selector(".meta").text_content()
        assert tab.page.query_selector(".msg.user img.thumb")  # the sent image, shown in its message
        assert not tab.page.query_selector("#attachments img")  # the attachment went with the message
        tab.send("Hello")  # the refused message left the conversation: this one is answered
        tab.page.wait_for_selector('.msg.assistant[data-state="done"]')
        assert all("400" in e for e in tab.errors), tab.errors  # only the browser's note of the 400
    finally:
        tab.close()


def test_a_pasted_image_is_answered_by_a_seeing_model(browser, tmp_path):
    transformers = pytest.importorskip("transformers")
    import base64

    from tests.multimodal.image_files import data_url, png
    from tests.multimodal.tiny_gemma3_vision import write_model_dir
    from tests.server.conftest import serve

    write_model_dir(tmp_path, transformers)
    with serve(None, EngineConfig(model=str(tmp_path), parallel=2, block_size=8, speculative_ngram=0),
               ServerConfig()) as served:
        expected = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
            "model": served.model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(png(2))}}, {"type": "text", "text": "What?"}]}]})
        tab = Page(browser, served.url)
        try:
            tab.wait_live()
            tab.settings(temperature=0, max_tokens=4)
            tab.page.evaluate(_PASTE, [base64.b64encode(png(2)).decode(), "pasted.png"])
            tab.page.wait_for_selector("#attachments img.thumb")
            tab.send("What?")
            reply = tab.page.wait_for_selector('.msg.assistant[data-state="done"]')
            answer = expected.json()["choices"][0]["message"]["content"]
            assert answer and reply.query_selector(".content").text_content() == answer
            assert not tab.errors, tab.errors
        finally:
            tab.close()
