"""SmolLM2 across real processes: router + two prefill nodes + one decode node on loopback give
byte-identical text, finish_reason and usage to one node (the decode node's own HTTP API, the
single-node path), for 16 greedy requests (half streamed), and whole responses for the parity
battery's structured, tool and logprob items."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from cluster_harness import call, start, wait_healthy  # noqa: E402
from parity_battery import battery, fetch  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.batch_invariant, pytest.mark.timeout(300)]


def test_smollm2_through_the_router_equals_one_node(tmp_path):
    logs = str(tmp_path)
    # The decode node's own HTTP API is the single-node path (same model and flags): the reference.
    decode = start("decode", None, logs, "decode")
    prefills = [start(f"prefill-{i}", None, logs, "prefill", ["--decode-peers", decode.serving]) for i in range(2)]
    router = start("router", None, logs, "router", ["--prefill-peers", ",".join(p.serving for p in prefills),
                                                   "--decode-peers", decode.serving,
                                                   "--health-check-interval", "0.25"], serving=False)
    procs = [decode, *prefills, router]
    single = decode
    try:
        wait_healthy(procs, timeout=240)
        topics = ["the sea", "a robot", "mountains", "bread", "rain", "a library", "trains", "owls"]
        work = [("/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Write two sentences about {topics[i % 8]}."}],
            "max_tokens": 12 + i, "temperature": 0, "stream": i % 2 == 0,
            **({"stream_options": {"include_usage": True}} if i % 2 == 0 else {})}) for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            reference = list(pool.map(lambda w: call(single.url, *w), work))
            routed = list(pool.map(lambda w: call(router.url, *w), work))
        assert routed == reference
        assert all(r["text"] for r in reference)
        # The parity battery's structured, tool and logprob items on a real model, whole responses compared.
        items = battery()
        work = [items[name] for name in ("json-schema", "tools-auto", "tools-required-streamed", "tool-result-turn",
                                         "logprobs-streamed", "n2-seeded")]
        with ThreadPoolExecutor(len(work)) as pool:
            reference = list(pool.map(lambda w: fetch(single.url, *w), work))
            routed = list(pool.map(lambda w: fetch(router.url, *w), work))
        assert routed == reference
        stats = httpx.get(f"{router.url}/router/stats").json()
        assert all(n["dispatched"] > 0 for n in stats["prefill"]) and stats["routing"]["retries"] == 0
    finally:
        for proc in procs:
            proc.stop()
