"""Percentiles and the per-level summary of a list of `RequestRecord`s."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from conveyor.bench.client import RequestRecord

_MAX_ERROR_SAMPLES = 5


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: list[float], scale: float = 1.0) -> Percentiles:
        scaled = [v * scale for v in values]
        mean = sum(scaled) / len(scaled) if scaled else math.nan
        top = max(scaled) if scaled else math.nan
        return cls(percentile(scaled, 50), percentile(scaled, 95), percentile(scaled, 99), mean, top)


@dataclass(frozen=True)
class LevelStats:
    """One concurrency level. Latencies in milliseconds; rates per second of the level's wall time."""

    concurrency: int
    request_rate: float | None  # Poisson arrivals per second; None for closed loop
    num_requests: int
    num_errors: int
    wall_s: float
    num_output_tokens: int  # successful requests only
    output_tok_s: float
    requests_s: float  # successful requests per second
    ttft_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    tpot_ms: Percentiles  # (e2e - ttft) / (tokens - 1): per-token decode time, immune to chunking
    error_samples: tuple[str, ...] = ()  # most common error messages, most frequent first


def _tpot_s(record: RequestRecord) -> float | None:
    if record.ttft_s is None or record.num_output_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.num_output_tokens - 1)


def compute_level_stats(
    records: list[RequestRecord], wall_s: float, concurrency: int, request_rate: float | None = None
) -> LevelStats:
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if not r.ok)
    num_tokens = sum(r.num_output_tokens for r in ok)
    ms = 1000.0
    return LevelStats(
        concurrency=concurrency,
        request_rate=request_rate,
        num_requests=len(records),
        num_errors=sum(errors.values()),
        wall_s=wall_s,
        num_output_tokens=num_tokens,
        output_tok_s=num_tokens / wall_s if wall_s > 0 else 0.0,
        requests_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft_ms=Percentiles.of([r.ttft_s for r in ok if r.ttft_s is not None], ms),
        itl_ms=Percentiles.of([gap for r in ok for gap in r.itl_s], ms),
        e2e_ms=Percentiles.of([r.e2e_s for r in ok], ms),
        tpot_ms=Percentiles.of([t for r in ok if (t := _tpot_s(r)) is not None], ms),
        error_samples=tuple(msg for msg, _ in errors.most_common(_MAX_ERROR_SAMPLES) if msg),
    )
