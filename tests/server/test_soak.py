"""The soak's CI size: 120 mixed requests at concurrency 24 with ~20% of clients leaving early.

The soak drives a server it is given; here that is an in-process one over the tiny random model, so
the test can also check the block pool's integrity. The long run is `python -m conveyor.bench.soak
--url ...` against a server you start (1,200 requests; numbers in benchmarks/results.md).
"""

from __future__ import annotations

import os

from conveyor.bench.soak import SoakResult, check_counts, make_specs, soak
from conveyor.config import EngineConfig, ServerConfig


def test_short_soak_no_5xx_nothing_leaks_metrics_equal_responses(serve_tiny):
    concurrency = 24
    engine = EngineConfig(parallel=8, max_queue_depth=max(256, concurrency * 8))
    with serve_tiny(engine, ServerConfig(metrics=True)) as served:
        result, report = soak(served.url, 120, concurrency=concurrency, seed=0, warmup=16, server_pid=os.getpid())
        served.core.pool.check_integrity()
    assert not result.failures, "\n".join(result.failures[:10])
    assert set(result.statuses) == {200}
    assert sum(result.leaves.values()) >= 12 and len(result.leaves) == 3  # every way of leaving happened
    assert result.finish_reasons["stop"] and result.finish_reasons["length"]
    assert report["metrics"]["finished abort"] == result.abandoned_choices > 0
    assert report["live_blocks"] == 0


def test_the_mix_has_what_the_soak_promises():
    specs = make_specs(1000, seed=0)
    leaves = [s for s in specs if s.leave]
    assert 150 <= len(leaves) <= 250
    assert any(s.body.get("n", 1) > 1 for s in specs) and any(s.body.get("stop") for s in specs)
    assert any(s.body.get("stream") for s in specs) and any(not s.body.get("stream") for s in specs)
    assert all(s.body["max_tokens"] >= 200 and s.body["ignore_eos"] for s in leaves)


def test_a_miscount_is_caught():
    result = SoakResult()
    result.finish_reasons["stop"] = 3
    before = {'conveyor_requests_finished_total{finish_reason="stop"}': 1.0}
    after = {'conveyor_requests_finished_total{finish_reason="stop"}': 3.0}  # 2 counted, 3 seen
    check_counts(before, after, result)
    assert any("finished stop" in f for f in result.failures)
