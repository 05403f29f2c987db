"""llama-server's slot persistence: POST /slots/{id}?action=save|restore|erase over a real socket, and the
prefix cache's two tiers in /v1/cache/stats and /metrics."""

import os

import httpx
import pytest

from conveyor.config import EngineConfig, ServerConfig

PROMPT = "You are a careful assistant who answers in one short sentence. " * 8 + "Say hello."
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def slot_server(serve_tiny, tmp_path):
    slots = tmp_path / "slots"
    config = EngineConfig(parallel=2, slot_save_path=str(slots), prompt_cache_dir=str(tmp_path / "cache"))
    with serve_tiny(config, ServerConfig(metrics=True)) as served:
        yield served, slots


def _completion(url):
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _cache(url):
    return httpx.get(f"{url}/v1/cache/stats", timeout=30).json()


def test_save_erase_restore_then_hit(slot_server):
    served, slots = slot_server
    url = served.url
    cold = _completion(url)

    r = httpx.post(f"{url}/slots/0?action=save", json={"filename": "agent.bin"}, timeout=60)
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["id_slot"] == 0 and saved["filename"] == "agent.bin"
    assert saved["n_saved"] >= 16 * 4 and saved["n_saved"] % 16 == 0
    assert saved["n_written"] > 0 and "save_ms" in saved["timings"]
    assert (slots / "agent.bin").exists()

    cached = _cache(url)["tiers"]["ram"]["entries"]
    r = httpx.post(f"{url}/slots/0?action=erase", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["id_slot"] == 0 and r.json()["n_erased"] >= saved["n_saved"]
    assert _cache(url)["tiers"]["ram"]["entries"] <= cached - saved["n_saved"] // 16

    r = httpx.post(f"{url}/slots/1?action=restore", json={"filename": "agent.bin"}, timeout=60)
    assert r.status_code == 200, r.text
    restored = r.json()
    assert restored["id_slot"] == 1 and restored["n_restored"] == saved["n_saved"]
    assert restored["n_read"] > 0 and "restore_ms" in restored["timings"]

    hits = _cache(url)["prefix_cache"]["hit_tokens"]
    assert _completion(url) == cold  # bitwise: the restored blocks are the cold prefill's
    assert _cache(url)["prefix_cache"]["hit_tokens"] - hits >= saved["n_saved"]
    served.core.kv.check_integrity()


@pytest.mark.parametrize("filename", ["../escape.bin", "a/b.bin", "..", "/etc/passwd", ".hidden", "", 7])
def test_bad_filenames_are_refused(slot_server, filename):
    served, slots = slot_server
    for action in ("save", "restore"):
        r = httpx.post(f"{served.url}/slots/0?action={action}", json={"filename": filename}, timeout=30)
        assert r.status_code == 400, r.text
        assert "filename" in r.json()["error"]["message"].lower()
    assert not (slots.parent / "escape.bin").exists()


def test_unknown_slot_action_and_file(slot_server):
    served, _ = slot_server
    r = httpx.post(f"{served.url}/slots/99?action=save", json={"filename": "x.bin"}, timeout=30)
    assert r.status_code == 400 and "slot" in r.json()["error"]["message"].lower()
    r = httpx.post(f"{served.url}/slots/0?action=teleport", json={"filename": "x.bin"}, timeout=30)
    assert r.status_code == 400 and "action" in r.json()["error"]["message"].lower()
    r = httpx.post(f"{served.url}/slots/0?action=restore", json={"filename": "missing.bin"}, timeout=30)
    assert r.status_code == 404


def test_cache_tiers_in_stats_and_metrics(slot_server):
    served, _ = slot_server
    _completion(served.url)
    disk = _cache(served.url)["tiers"]["disk"]
    for field in ("entries", "bytes", "budget_bytes", "hits", "preloaded", "writes", "dropped", "rejected", "corrupt"):
        assert field in disk
    assert disk["budget_bytes"] == 8 << 30
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    for name in ("entries", "bytes", "budget_bytes", "hits_total", "preloaded_total", "writes_total", "dropped_total",
                 "rejected_total", "corrupt_total"):
        assert f"conveyor_prompt_cache_disk_{name}" in text


def test_slot_actions_without_a_save_path_are_not_supported(served):
    r = httpx.post(f"{served.url}/slots/0?action=save", json={"filename": "x.bin"}, timeout=30)
    assert r.status_code == 501
    assert _cache(served.url)["tiers"]["disk"] is None


def test_slot_save_path_alone_keeps_blocks_under_it(serve_tiny, tmp_path):
    with serve_tiny(EngineConfig(parallel=2, slot_save_path=str(tmp_path)), ServerConfig()) as served:
        _completion(served.url)
        r = httpx.post(f"{served.url}/slots/0?action=save", json={"filename": "only.bin"}, timeout=60)
        assert r.status_code == 200 and r.json()["n_saved"] > 0
        assert os.listdir(tmp_path / "blocks")
        assert _cache(served.url)["tiers"]["disk"]["consult"] is False


def test_a_server_restart_serves_the_prompt_from_disk(serve_tiny, tmp_path):
    config = EngineConfig(parallel=2, prompt_cache_dir=str(tmp_path))
    with serve_tiny(config, ServerConfig()) as served:
        cold = _completion(served.url)
    # The server's exit (lifespan -> engine thread) wrote the cached blocks.
    assert any(name.endswith(".kvb") for name in os.listdir(tmp_path))
    with serve_tiny(config, ServerConfig()) as served:
        assert _completion(served.url) == cold
        disk = _cache(served.url)["tiers"]["disk"]
        assert disk["hits"] >= 4 and disk["corrupt"] == disk["rejected"] == 0
