"""/health, /slots, /props, /metrics, /v1/cache/stats and /v1/loads: shapes and live values."""

from __future__ import annotations

import httpx

METRIC_NAMES = [
    "conveyor_requests_finished_total", "conveyor_requests_rejected_total", "conveyor_num_requests_running",
    "conveyor_num_requests_waiting", "conveyor_batch_size_bucket", "conveyor_time_to_first_token_seconds_bucket",
    "conveyor_inter_token_latency_seconds_bucket", "conveyor_e2e_request_latency_seconds_bucket",
    "conveyor_prompt_tokens_total", "conveyor_generation_tokens_total", "conveyor_kv_blocks_used",
    "conveyor_kv_blocks_free", "conveyor_kv_blocks_total", "conveyor_preemptions_total",
    "conveyor_prefix_cache_hit_tokens_total", "conveyor_prefix_cache_miss_tokens_total", "conveyor_engine_healthy",
    "conveyor_reclaim_passes_total", "conveyor_prefill_grants_total", "conveyor_mixed_steps_total",
    "conveyor_spec_draft_tokens_total", "conveyor_spec_accepted_tokens_total",
    "conveyor_kv_evictions_total", "conveyor_kv_blocks_shared", "conveyor_kernel_backend_info",
]


def _get(served, path: str) -> dict:
    r = httpx.get(f"{served.url}{path}")
    assert r.status_code == 200, r.text
    return r.json()


def test_health_when_idle(served):
    body = _get(served, "/health")
    assert body["status"] == "ok"
    assert set(body["batch"]) == {"active_sequences", "queued_requests", "total_completed"}
    assert body["batch"]["active_sequences"] == 0 and body["batch"]["queued_requests"] == 0
    assert body["slots"] == {"total": 4, "idle": 4, "processing": 0}
    assert body["n_ctx_slot"] == served.core.max_model_len


def test_slots_and_health_while_busy(served):
    long = {"prompt": "busy", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=long, timeout=30) as r:
        lines = r.iter_lines()  # NOTE: keep a reference; a dropped line iterator closes the connection
        while not next(lines).startswith("data: "):
            pass
        slots = _get(served, "/slots")
        health = _get(served, "/health")
        busy_slot_503 = httpx.get(f"{served.url}/slots", params={"fail_on_no_slot": 1}).status_code
    assert len(slots) == 4 and [s["id"] for s in slots] == [0, 1, 2, 3]
    busy = [s for s in slots if s["is_processing"]]
    assert len(busy) == 1
    slot = busy[0]
    assert slot["state"] == "processing" and slot["id_task"] and slot["n_ctx"] == served.core.max_model_len
    assert slot["n_prompt_tokens"] >= 1 and slot["n_decoded"] >= 1
    assert all(s["state"] == "idle" and s["id_task"] is None for s in slots if not s["is_processing"])
    assert health["batch"]["active_sequences"] == 1 and health["slots"]["processing"] == 1
    assert busy_slot_503 == 200  # three slots are still idle
    served.wait_until(lambda: served.core.pool.stats().num_used == 0, what="the stream's blocks to be freed")


def test_props(served):
    props = _get(served, "/props")
    assert props["default_generation_settings"]["n_ctx"] == served.core.max_model_len
    assert props["total_slots"] == 4 and props["model_alias"] == served.model
    assert props["architecture"] == "llama" and props["sliding_window"] is None
    assert "<|im_start|>" in props["chat_template"]
    kernels = props["kernels"]
    backend = served.core.backend
    assert kernels == {"backend": backend.name, "arch": backend.arch, "batch_invariant": backend.batch_invariant,
                       "speculation": served.core.scheduler.config.speculative_ngram > 0}
    assert _get(served, "/health")["kernels"] == kernels
    weights = props["weights"]  # the tiny float model: packed bf16, bytes as the KV plan counted them
    assert weights["weight_dtype"] == "auto" and weights["formats"] == served.core.weight_formats
    assert weights["bytes"] == sum(weights["formats"].values()) > 0 and "BF16" in weights["formats"]


def test_kernel_backend_metric_carries_the_backend(served):
    text = httpx.get(f"{served.url}/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("conveyor_kernel_backend_info{"))
    assert f'backend="{served.core.backend.name}"' in line and line.endswith(" 1.0")


def test_metrics_exposition(served):
    served.client().completions.create(model=served.model, prompt="metrics", max_tokens=4, temperature=0)
    text = httpx.get(f"{served.url}/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["conveyor_generation_tokens_total"] >= 4
    assert values["conveyor_time_to_first_token_seconds_count"] >= 1
    assert values["conveyor_inter_token_latency_seconds_count"] >= 3
    assert values["conveyor_kv_blocks_total"] == served.core.pool.num_blocks
    # Every successful step is in the batch-size histogram (counted, not sampled).
    assert values['conveyor_batch_size_bucket{le="+Inf"}'] == served.core.counters.num_steps >= 4


def test_cache_stats(served):
    stats = _get(served, "/v1/cache/stats")
    plan = served.core.pool_plan
    assert stats["block_size"] == served.core.kv.block_size
    assert stats["allocated"] == plan.num_blocks == stats["live"] + stats["free"]
    assert stats["bytes_reserved"] == plan.num_blocks * plan.bytes_per_block
    assert stats["bytes_in_use"] == stats["live"] * plan.bytes_per_block
    assert stats["budget_bytes"] == plan.budget_bytes
    assert set(stats["prefix_cache"]) == {"enabled", "hit_tokens", "miss_tokens", "hit_rate",
                                          "partial_block_hit_tokens"}
    assert stats["sliding_window_group"] is None  # no sliding layers: one group, the figures above


def test_loads_in_sglang_schema(served):
    loads = _get(served, "/v1/loads")
    assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    rank = loads["loads"][0]
    assert set(rank) == {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                         "max_total_num_tokens", "token_usage"}
    assert rank["max_total_num_tokens"] == served.core.pool.num_blocks * served.core.kv.block_size
    assert 0.0 <= rank["token_usage"] <= 1.0
