"""Read-only views of engine state: /health, /slots, /props, /v1/loads, /v1/cache/stats.

They run on the event loop while the engine thread steps; each reads a snapshot (a list
copy, a few ints), so a view can be one step stale but never inconsistent enough to crash.
"""

from __future__ import annotations

from importlib import metadata

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.request import Request, RequestStatus
from conveyor.engine.sampling_params import SamplingParams


def health(engine: AsyncEngine, draining: bool) -> tuple[int, dict]:
    """(HTTP status, body): 200 only while requests can be served."""
    if engine.dead_reason is not None:
        return 503, {"status": "error", "error": engine.dead_reason}
    if not engine.is_alive:
        return 503, {"status": "loading"}
    core = engine.core
    running = engine.num_running
    body = {
        "status": "shutting_down" if draining else "ok",
        "batch": {"active_sequences": running, "queued_requests": engine.num_waiting,
                  "total_completed": core.scheduler.stats.num_completed},
        "slots": {"total": core.max_batch_size, "idle": max(core.max_batch_size - running, 0),
                  "processing": running},
        "n_ctx_slot": core.max_model_len,
        "kernels": core.kernel_report(),
    }
    return (503 if draining else 200), body


def slots(engine: AsyncEngine) -> list[dict]:
    """llama-server style per-slot state. Slot ids are positions in the running batch."""
    core = engine.core
    running: list[Request] = list(core.scheduler.running)
    out = [_slot(i, running[i] if i < len(running) else None, core.max_model_len)
           for i in range(core.max_batch_size)]
    if core.states is not None:  # hybrid models: where each sequence's recurrent state lives
        for slot in out:
            slot["state_slot"] = core.kv.state_slot(slot["id_task"]) if slot["id_task"] else None
    return out


def _slot(slot_id: int, request: Request | None, n_ctx: int) -> dict:
    if request is None:
        return {"id": slot_id, "state": "idle", "is_processing": False, "id_task": None, "n_ctx": n_ctx,
                "n_prompt_tokens": 0, "n_decoded": 0, "n_past": 0}
    phase = "prefilling" if request.status == RequestStatus.PREFILLING else "decoding"
    return {"id": slot_id, "state": "processing", "is_processing": True, "id_task": request.request_id,
            "phase": phase, "n_ctx": n_ctx, "n_prompt_tokens": request.num_prompt_tokens,
            "n_decoded": len(request.output_token_ids), "n_past": request.num_computed_tokens,
            "n_cached": request.num_cached_tokens, "priority": request.priority}


def props(engine: AsyncEngine, model_id: str) -> dict:
    core = engine.core
    defaults = SamplingParams()
    return {
        "default_generation_settings": {
            "n_ctx": core.max_model_len,
            "params": {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
                       "min_p": defaults.min_p, "repeat_penalty": defaults.repetition_penalty,
                       "presence_penalty": defaults.presence_penalty,
                       "frequency_penalty": defaults.frequency_penalty,
                       "max_tokens": "remaining context window"},
        },
        "total_slots": core.max_batch_size,
        "model_alias": model_id,
        "model_name": core.model_name,
        "architecture": core.model_config.architecture,
        "sliding_window": core.model_config.sliding_window,
        "layers": core.layers_report(),
        "model_path": core.config.model or "bundled SmolLM2-135M-Instruct",
        "chat_template": core.tokenizer.chat_template or "",
        "bos_token": _piece(engine, core.tokenizer.bos_token_id),
        "eos_token": [_piece(engine, t) for t in sorted(core.eos_token_ids)],
        "max_queue_depth": engine.max_queue_depth,
        "kv_block_size": core.kv.block_size,
        "kv_cache_type": core.kv_types.describe(),
        "prefix_caching": core.config.enable_prefix_caching,
        "modalities": {"vision": core.vision is not None, "audio": False},
        "build_info": f"conveyor {_version()}",
        "kernels": core.kernel_report(),
        "weights": core.weights_report(),
        "speculation": core.speculation_report(),
    }


def _version() -> str:
    try:
        return metadata.version("conveyor")
    except metadata.PackageNotFoundError:
        return "unknown"


def _piece(engine: AsyncEngine, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    try:
        return engine.core.tokenizer.id_to_piece(token_id)
    except IndexError:
        return None


def loads(engine: AsyncEngine) -> dict:
    """SGLang's /v1/loads schema (one data-parallel rank)."""
    core = engine.core
    stats = core.pool.stats()
    max_tokens = stats.num_blocks * core.kv.block_size
    used_tokens = stats.num_used * core.kv.block_size
    return {"dp_rank_count": 1, "loads": [{
        "dp_rank": 0, "num_running_reqs": engine.num_running, "num_waiting_reqs": engine.num_waiting,
        "num_used_tokens": used_tokens, "max_total_num_tokens": max_tokens,
        "token_usage": round(used_tokens / max_tokens, 4) if max_tokens else 0.0,
    }]}


def cache_stats(engine: AsyncEngine) -> dict:
    core = engine.core
    stats = core.pool.stats()
    plan = core.pool_plan
    hits, misses = core.kv.counters.hit_tokens, core.kv.counters.miss_tokens
    return {
        "block_size": core.kv.block_size,
        "allocated": stats.num_blocks,
        "live": stats.num_used,
        "free": stats.num_free,
        "cached": stats.num_cached,
        "cached_free": stats.num_cached_free,
        "shared": stats.num_shared,
        "evictions": stats.num_evictions,
        "cache_type_k": core.kv_types.k,
        "cache_type_v": core.kv_types.v,
        "bytes_per_block": plan.bytes_per_block,
        "bytes_reserved": stats.num_blocks * plan.bytes_per_block,
        "bytes_in_use": stats.num_used * plan.bytes_per_block,
        "budget_bytes": plan.budget_bytes,
        "budget_source": plan.budget_source,
        "prefix_cache": {"enabled": core.config.enable_prefix_caching, "hit_tokens": hits, "miss_tokens": misses,
                         # of hit_tokens, those adopted from the leading part of a cached block (token-level reuse)
                         "partial_block_hit_tokens": core.kv.counters.partial_hit_tokens,
                         "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0},
        "recurrent_state": core.state_report(),  # hybrid models' per-sequence state slots, else null
        # Sliding layers' own block group (the figures above are then the full-attention layers'), else null.
        "sliding_window_group": core.window_report(),
        # The prefix cache's two tiers: RAM (the cached blocks above) and disk (--prompt-cache-dir, else null).
        "tiers": {"ram": core.ram_report(), "disk": core.disk_report()},
    }
