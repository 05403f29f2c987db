"""The built-in page's HTTP side: its files, --no-webui, and the dashboard snapshot and stream."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from conveyor.config import EngineConfig, ModelsConfig, ServerConfig
from conveyor.server.dashboard import Rates
from conveyor.server.webui import load_assets

def test_page_and_its_files_are_served_without_external_urls(served):
    page = httpx.get(f"{served.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/webui/webui.js"' in page.text
    js = httpx.get(f"{served.url}/webui/webui.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert "/v1/dashboard/stream" in js.text and "/v1/chat/completions" in js.text
    assert httpx.get(f"{served.url}/webui/webui.css").status_code == 200
    assert httpx.get(f"{served.url}/webui/secret.py").status_code == 404
    for name, data in load_assets().items():  # nothing is fetched from anywhere else (no CDN)
        assert not re.search(rb"(?<![\w-])(https?:)?//[a-z0-9]", data), name


def test_page_runs_no_inline_script():
    """CSP script-src 'self': an inline script or on* handler would not run (and must not be needed)."""
    page = load_assets()["index.html"].decode()
    assert re.findall(r"<script\b[^>]*>", page) == ['<script src="/webui/webui.js" defer>']
    assert not re.search(r"\son[a-z]+\s*=", page)


def test_page_has_a_model_picker_fed_by_v1_models():
    """A <select> in the chat panel, hidden until /v1/models lists several models; the choice is the chat's
    `model` and the dashboard's ?model=, and the server's names reach the page only as text."""
    assets = {name: data.decode() for name, data in load_assets().items()}
    page, js = assets["index.html"], assets["webui.js"]
    chat = page[page.index('<section id="chat"'):page.index("</section>")]
    assert re.search(r'<label id="model-picker" hidden>[^<]*<select id="model-select">', chat)
    assert 'api("/v1/models")' in js and "MODELS_POLL_MS" in js  # fetched on load and every few seconds
    assert '$("model-select").addEventListener("change", pickModel)' in js
    assert "model: state.model" in js  # the chat request's body
    assert "/v1/dashboard/stream?model=${encodeURIComponent(card.id)}" in js
    assert "state.models.length > 1" in js  # one model: no picker, as before
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js


@pytest.fixture(scope="module")
def multi_model_dir(tmp_path_factory) -> str:
    from conveyor.testing import write_tiny_model_dir

    folder = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("alpha", "beta")):
        write_tiny_model_dir(folder / name, seed=seed)
    return str(folder)


def test_multi_model_server_gives_the_page_what_its_picker_reads(multi_model_dir):
    """The page's side of the contract: the multi-model front serves it, /v1/models lists each model with
    `status.value`, and ?model= picks the model whose dashboard is read."""
    from fastapi.testclient import TestClient

    from conveyor.server.multimodel.serve import build_multi_model_app

    multi = build_multi_model_app(ModelsConfig(models_dir=multi_model_dir),
                                  EngineConfig(parallel=2, kv_cache_budget="8M"), ServerConfig())
    with TestClient(multi) as client:
        assert 'id="model-select"' in client.get("/").text
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["status"]["value"]) for c in cards] == [("alpha", "unloaded"), ("beta", "unloaded")]
        # a GET of a model's state never loads it (nor holds it: a watching page never blocks an unload)
        refused = client.get("/v1/dashboard", params={"model": "beta"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_loaded"
        assert client.post("/models/load", json={"model": "beta"}).status_code == 200
        snapshot = client.get("/v1/dashboard", params={"model": "beta"}).json()
        assert snapshot["model"] == "beta"
        states = {c["id"]: c["status"]["value"] for c in client.get("/v1/models").json()["data"]}
        assert states == {"alpha": "unloaded", "beta": "loaded"}
        assert multi.registry.entries["beta"].num_active == 0


def test_no_webui_flag_turns_the_page_off(serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(webui=False)) as served:
        assert httpx.get(f"{served.url}/").status_code == 404
        assert httpx.get(f"{served.url}/webui/webui.js").status_code == 404
        assert httpx.get(f"{served.url}/v1/dashboard").status_code == 200  # the data stays


def test_snapshot_lists_running_and_queued_requests(served, long_streams):
    """4 slots, 6 long requests: 4 rows running (prefilling or decoding), 2 queued."""
    streams = long_streams(served.url, 6)
    try:
        served.wait_until(lambda: served.core.scheduler.num_running == 4 and served.core.scheduler.num_waiting == 2,
                          timeout=60, what="4 running and 2 queued")
        snap = httpx.get(f"{served.url}/v1/dashboard").json()
        states = [r["state"] for r in snap["requests"]]
        assert snap["slots_total"] == 4 and snap["queue_depth"] == 2
        assert set(states[:4]) <= {"prefilling", "decoding"} and states[4:] == ["queued"] * 2
        assert snap["kv"]["used"] > 0
        assert snap["kv"]["used"] + snap["kv"]["cached_free"] + snap["kv"]["free"] == snap["kv"]["total"]
        assert snap["kernels"]["backend"] and snap["weights"]["weight_dtype"]
        assert snap["model"] == served.model
    finally:
        streams.close()
    served.wait_until(lambda: served.core.pool.stats().num_used == 0, what="KV blocks freed")


def test_stream_pushes_snapshots_with_rates(served):
    with httpx.stream("GET", f"{served.url}/v1/dashboard/stream", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    break
    assert events[0]["rates"] == {"tok_s": None, "ttft_s": None}  # no interval yet
    assert events[1]["rates"]["tok_s"] is not None and events[1]["time"] > events[0]["time"]


def test_dashboard_needs_the_api_key(serve_tiny):
    with serve_tiny(EngineConfig(parallel=2), ServerConfig(api_key="k")) as served:
        assert httpx.get(f"{served.url}/v1/dashboard/stream").status_code == 401
        assert httpx.get(f"{served.url}/").status_code == 200
        ok = httpx.get(f"{served.url}/v1/dashboard", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["role"] == "node"


def test_rates_are_counter_differences():
    rates = Rates()
    assert rates.update({"generated_tokens": 10, "ttft_sum": 1.0, "ttft_count": 2}, now=100.0) == \
        {"tok_s": None, "ttft_s": None}
    # 50 tokens in 0.5 s; two first tokens arrived, 0.3 s and 0.5 s after their requests.
    got = rates.update({"generated_tokens": 60, "ttft_sum": 1.8, "ttft_count": 4}, now=100.5)
    assert got == {"tok_s": 100.0, "ttft_s": pytest.approx(0.4)}
    assert rates.update({"generated_tokens": 60, "ttft_sum": 1.8, "ttft_count": 4}, now=101.0)["ttft_s"] is None


def test_request_rows_name_each_state():
    from conveyor.engine.request import Request, RequestStatus
    from conveyor.engine.sampling_params import SamplingParams
    from conveyor.server.dashboard import _request_row

    def request(status: RequestStatus, computed: int = 0, outputs: int = 0, preemptions: int = 0) -> Request:
        r = Request("r", list(range(10)), SamplingParams(max_tokens=50), status=status, num_computed_tokens=computed,
                    num_preemptions=preemptions)
        r.output_token_ids = [1] * outputs
        r.first_token_time = 100.0 if outputs else None
        return r

    assert _request_row(request(RequestStatus.QUEUED), 101.0)["state"] == "queued"
    assert _request_row(request(RequestStatus.QUEUED, outputs=3, preemptions=1), 101.0)["state"] == "preempted"
    prefill = _request_row(request(RequestStatus.PREFILLING, computed=4), 101.0)
    assert (prefill["state"], prefill["computed_tokens"], prefill["prompt_tokens"], prefill["tok_s"]) == \
        ("prefilling", 4, 10, None)
    embedding = request(RequestStatus.PREFILLING, computed=4)
    embedding.pooling = True  # an embedding or a reranker's score: its prefill is all it does
    assert _request_row(embedding, 101.0)["state"] == "pooling"
    decode = _request_row(request(RequestStatus.DECODING, computed=14, outputs=5), 102.0)
    assert (decode["state"], decode["output_tokens"], decode["tok_s"]) == ("decoding", 5, 2.0)  # 4 tokens in 2 s
