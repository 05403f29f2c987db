import math

from conveyor.bench.client import RequestRecord
from conveyor.bench.stats import Percentiles, compute_level_stats, percentile


def test_percentile_matches_linear_interpolation():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50.5
    assert percentile(values, 95) == 95.05
    assert math.isclose(percentile(values, 99), 99.01)
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_percentiles_scale_and_empty():
    p = Percentiles.of([0.001, 0.002, 0.003], scale=1000.0)
    assert (p.p50, p.mean) == (2.0, 2.0)
    assert math.isnan(Percentiles.of([]).p50)


def _record(start, chunk_times, tokens, error=None):
    return RequestRecord(start_s=start, end_s=chunk_times[-1] if chunk_times else start + 0.1,
                         chunk_times_s=list(chunk_times), num_output_tokens=tokens, error=error)


def test_level_stats_from_hand_built_records():
    records = [
        _record(0.0, [0.1, 0.2, 0.3], 3),  # ttft 100 ms, gaps 100/100 ms, e2e 300 ms
        _record(0.0, [0.2, 0.25, 0.3, 0.35, 0.4], 5),  # ttft 200 ms, gaps 4 x 50 ms, e2e 400 ms
        _record(0.0, [], 0, error="HTTP 503: overloaded"),
        _record(0.0, [], 0, error="HTTP 503: overloaded"),
    ]
    stats = compute_level_stats(records, wall_s=2.0, concurrency=4)
    assert stats.num_requests == 4 and stats.num_errors == 2
    assert stats.num_output_tokens == 8
    assert stats.output_tok_s == 4.0 and stats.requests_s == 1.0
    assert math.isclose(stats.ttft_ms.p50, 150.0)
    assert math.isclose(stats.itl_ms.p50, 50.0) and math.isclose(stats.itl_ms.p99, 100.0)
    assert math.isclose(stats.e2e_ms.p50, 350.0)
    assert math.isclose(stats.tpot_ms.p50, 75.0)  # (200/2, 200/4) ms per token
    assert stats.error_samples == ("HTTP 503: overloaded",)


def test_level_stats_all_failed_is_nan_not_crash():
    stats = compute_level_stats([_record(0.0, [], 0, error="boom")], wall_s=1.0, concurrency=1)
    assert stats.num_errors == 1 and stats.output_tok_s == 0.0
    assert math.isnan(stats.ttft_ms.p50)
