"""The web page's live view: one snapshot of the engine, pushed a few times per second as SSE.

A snapshot reads the state /slots, /v1/cache/stats and /metrics read (the scheduler's lists and
stats, the block pool, the server's TTFT histogram); rates are differences of those counters
between two pushes, so nothing here counts on its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.request import Request, RequestStatus
from conveyor.server import observability
from conveyor.server.metrics import ServerMetrics
from conveyor.server.responses import sse

PUSH_INTERVAL_S = 0.25


def engine_snapshot(engine: AsyncEngine, metrics: ServerMetrics, model_id: str) -> dict:
    """Everything the dashboard draws for one node; `counters` are cumulative (see `Rates`)."""
    core = engine.core
    now = time.monotonic()
    running, waiting = list(core.scheduler.running), list(core.scheduler.waiting)
    stats = core.scheduler.stats
    cache = observability.cache_stats(engine)
    ttft_sum, ttft_count = metrics.ttft_totals()
    return {
        "role": "node",
        "model": model_id,
        "kernels": core.kernel_report(),
        "weights": {"weight_dtype": core.config.weight_dtype, "formats": dict(core.weight_formats)},
        "slots_total": core.max_batch_size,
        "task": core.pooling_task or "generation",  # an embedding or reranking model's rows pool, not decode
        "requests": [_request_row(r, now) for r in running] + [_request_row(r, now) for r in waiting],
        "num_running": len(running),
        "queue_depth": engine.num_waiting,
        "max_queue_depth": engine.max_queue_depth,
        "kv": {"total": cache["allocated"], "used": cache["live"], "cached_free": cache["cached_free"],
               "free": cache["free"] - cache["cached_free"], "block_size": cache["block_size"]},
        "prefix_cache": cache["prefix_cache"],
        "state": cache["recurrent_state"],
        "tiers": cache["tiers"],
        "speculation": {"draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
                        "acceptance": (round(stats.num_accepted_tokens / stats.num_draft_tokens, 4)
                                       if stats.num_draft_tokens else None)},
        "completed": stats.num_completed,
        "counters": {"generated_tokens": stats.num_generated_tokens, "ttft_sum": ttft_sum, "ttft_count": ttft_count},
    }


def _request_row(request: Request, now: float) -> dict:
    status = request.status
    if status == RequestStatus.QUEUED:
        state = "preempted" if request.num_preemptions else "queued"
    elif status == RequestStatus.PREFILLING:
        state = "pooling" if request.pooling else "prefilling"  # an embedding or score: prefill, then its vector
    else:
        state = "decoding"
    num_output = len(request.output_token_ids)
    started = request.first_token_time
    # Tokens after the first over the time since it: the row's decode speed.
    tok_s = (num_output - 1) / (now - started) if started is not None and num_output > 1 and now > started else None
    return {"id": request.request_id, "state": state, "prompt_tokens": request.num_prompt_tokens,
            "computed_tokens": min(request.num_computed_tokens, request.num_prompt_tokens),
            "cached_tokens": request.num_cached_tokens, "output_tokens": num_output,
            "max_tokens": request.sampling_params.max_tokens, "preemptions": request.num_preemptions,
            "tok_s": round(tok_s, 2) if tok_s is not None else None}


@dataclass
class Rates:
    """Per-second rates from the cumulative counters of two consecutive snapshots."""

    _last: dict | None = None
    _last_time: float = 0.0

    def update(self, counters: dict, now: float) -> dict:
        last, last_time = self._last, self._last_time
        self._last, self._last_time = dict(counters), now
        if last is None or now <= last_time:
            return {"tok_s": None, "ttft_s": None}
        tokens = counters.get("generated_tokens")
        tok_s = (tokens - last["generated_tokens"]) / (now - last_time) if tokens is not None else None
        first_tokens = counters["ttft_count"] - last["ttft_count"]
        # The mean TTFT of the requests whose first token came since the last push (None when none did).
        ttft_s = (counters["ttft_sum"] - last["ttft_sum"]) / first_tokens if first_tokens > 0 else None
        return {"tok_s": round(tok_s, 2) if tok_s is not None else None,
                "ttft_s": round(ttft_s, 4) if ttft_s is not None else None}


async def snapshot_stream(build: Callable[[], dict], stop: Callable[[], bool],
                          interval_s: float = PUSH_INTERVAL_S) -> AsyncIterator[str]:
    """SSE: one `build()` snapshot (plus `time` and `rates`) every `interval_s` until `stop()`."""
    rates = Rates()
    while not stop():
        snapshot = build()
        now = time.monotonic()
        snapshot["time"] = time.time()
        snapshot["rates"] = rates.update(snapshot["counters"], now)
        yield sse(snapshot)
        await asyncio.sleep(interval_s)
