"""The router's snapshot for the web page: each node of both pools (with its models), routing counts,
router TTFT.

Read from the registry the health monitor and dispatch keep, and from the router's own TTFT
histogram (the state /router/stats and /metrics read); server/dashboard.py streams it.
"""

from __future__ import annotations

from conveyor.cluster.registry import Registry
from conveyor.server.metrics import histogram_totals


def router_snapshot(registry: Registry, metrics, num_awaiting_first_token: int, model_id: str) -> dict:
    """`metrics`: RouterMetrics (conveyor/cluster/router.py); `model_id`: the model whose TTFT and awaiting
    count are shown (the default, or the one the page's ?model= picked); nodes are shown with their models."""
    ttft_sum, ttft_count = histogram_totals(metrics.ttft, model=model_id)
    return {
        "role": "router",
        "model": model_id,
        "nodes": [{"role": node.role, **node.view()} for pool in registry.pools() for node in pool.nodes],
        "models": registry.models(),  # each model an online node serves -> its nodes by role
        "awaiting_first_token": num_awaiting_first_token,
        "routing": registry.stats.view(),
        # The router sees tokens only as they pass; it does not count them, so no tok/s here.
        "counters": {"generated_tokens": None, "ttft_sum": ttft_sum, "ttft_count": ttft_count},
    }
