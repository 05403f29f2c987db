"""The router's snapshot for the web page: each node of both pools, routing counts, router TTFT.

Read from the registry the health monitor and dispatch keep, and from the router's own TTFT
histogram (the state /router/stats and /metrics read); server/dashboard.py streams it.
"""

from __future__ import annotations

from conveyor.cluster.registry import Registry
from conveyor.server.metrics import histogram_totals


def router_snapshot(registry: Registry, metrics, serving, model_id: str) -> dict:
    """`metrics`: RouterMetrics, `serving`: RouterServing (conveyor/cluster/router.py)."""
    ttft_sum, ttft_count = histogram_totals(metrics.ttft)
    return {
        "role": "router",
        "model": model_id,
        "nodes": [{"role": node.role, **node.view()} for pool in registry.pools() for node in pool.nodes],
        "awaiting_first_token": serving.num_awaiting_first_token,
        "routing": registry.stats.view(),
        # The router sees tokens only as they pass; it does not count them, so no tok/s here.
        "counters": {"generated_tokens": None, "ttft_sum": ttft_sum, "ttft_count": ttft_count},
    }
