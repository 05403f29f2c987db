"""Prometheus metrics on a per-app registry.

Two sources: what the engine already counts is read at scrape time by `EngineCollector`
(never double-counted in the server), and latencies that only the server can see (TTFT,
inter-token, end-to-end) are measured from the arrival times of each request's deltas.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineCollector(Collector):
    """Gauges and counters the engine keeps itself, read when Prometheus scrapes."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        engine, core = self.engine, self.engine.core
        stats, pool = core.scheduler.stats, core.pool.stats()
        yield _gauge("conveyor_engine_healthy", "1 while the engine can serve requests", int(engine.is_alive))
        yield _gauge("conveyor_num_requests_running", "Requests admitted to the batch", engine.num_running)
        yield _gauge("conveyor_num_requests_waiting", "Requests queued for admission", engine.num_waiting)
        finished = CounterMetricFamily("conveyor_requests_finished", "Requests finished, by finish reason "
                                       "(abort = cancelled by the client or the server)", labels=["finish_reason"])
        # Every reason is always present, so rate() works from zero.
        counts = {"stop": 0, "length": 0, "abort": 0, "error": 0, **dict(stats.finished_by_reason)}
        for reason, count in counts.items():
            finished.add_metric([reason], count)
        yield finished
        # Counted once per request when it finishes, by the same reason: sum(usage) over the responses
        # that ended with a reason equals its series here.
        for name, doc, by_reason in (
                ("conveyor_request_prompt_tokens", "Prompt tokens of finished requests (the whole prompt, cache "
                 "hits included), by finish reason", stats.prompt_tokens_by_reason),
                ("conveyor_request_generation_tokens", "Output tokens of finished requests, by finish reason",
                 stats.generation_tokens_by_reason)):
            family = CounterMetricFamily(name, doc, labels=["finish_reason"])
            for reason, value in {**dict.fromkeys(counts, 0), **dict(by_reason)}.items():
                family.add_metric([reason], value)
            yield family
        yield _counter("conveyor_prompt_tokens", "Prompt tokens prefilled (prefix-cache hits excluded, "
                       "re-prefill after preemption included)", stats.num_prompt_tokens_computed)
        yield _counter("conveyor_generation_tokens", "Tokens generated", stats.num_generated_tokens)
        yield _counter("conveyor_preemptions", "Running requests preempted to free KV blocks", stats.num_preemptions)
        yield _counter("conveyor_prefix_cache_hit_tokens", "Prompt tokens adopted from the prefix cache",
                       core.kv.counters.hit_tokens)
        yield _counter("conveyor_prefix_cache_partial_block_hit_tokens", "Of the hit tokens, those adopted from "
                       "the leading part of a cached block (token-level reuse)", core.kv.counters.partial_hit_tokens)
        yield _counter("conveyor_prefix_cache_miss_tokens", "Prompt tokens that missed the prefix cache",
                       core.kv.counters.miss_tokens)
        yield _counter("conveyor_reclaim_passes", "Times a running row needed a KV block and another row was "
                       "preempted to free one", stats.num_reclaim_passes)
        yield _counter("conveyor_prefill_grants", "Ticks granted to a parked chunked prefill over live decode "
                       "(alternate tick policy)", stats.num_prefill_grants)
        yield _counter("conveyor_mixed_steps", "Forwards that carried decode rows and prefill together",
                       stats.num_mixed_steps)
        yield _counter("conveyor_spec_draft_tokens", "Speculative tokens proposed by prompt lookup and scored",
                       stats.num_draft_tokens)
        yield _counter("conveyor_spec_accepted_tokens", "Speculative tokens the model's greedy choice confirmed",
                       stats.num_accepted_tokens)
        yield _counter("conveyor_kv_evictions", "Cold cached-prefix blocks evicted for reuse", pool.num_evictions)
        yield _counter("conveyor_engine_steps", "Successful engine steps", core.counters.num_steps)
        yield _counter("conveyor_engine_failed_steps", "Engine steps whose forward raised",
                       core.counters.num_failed_steps)
        yield _gauge("conveyor_kv_blocks_total", "KV blocks in the pool", pool.num_blocks)
        yield _gauge("conveyor_kv_blocks_used", "KV blocks held by requests", pool.num_used)
        yield _gauge("conveyor_kv_blocks_free", "KV blocks free (including evictable cached prefixes)", pool.num_free)
        yield _gauge("conveyor_kv_blocks_cached", "KV blocks holding a reusable prefix", pool.num_cached)
        yield _gauge("conveyor_kv_blocks_shared", "KV blocks referenced by more than one sequence", pool.num_shared)
        state = core.state_report() or {"slots": 0, "live": 0, "snapshots": 0, "snapshot_hits": 0}
        yield _gauge("conveyor_state_slots_total", "Recurrent-state slots of a hybrid model (0 for others)",
                     state["slots"])
        yield _gauge("conveyor_state_slots_used", "Recurrent-state slots held by running sequences", state["live"])
        yield _gauge("conveyor_state_snapshots", "Recurrent-state snapshots kept for prefix-cache hits",
                     state["snapshots"])
        yield _counter("conveyor_state_snapshot_hits", "Admissions that resumed from a recurrent-state snapshot",
                       state["snapshot_hits"])
        yield from _disk_tier_metrics(core.disk_report())
        yield from _vision_metrics(core.runner.encoder_cache)
        yield _batch_size_histogram(dict(core.counters.batch_size_counts))
        kernels = core.kernel_report()
        info = GaugeMetricFamily("conveyor_kernel_backend_info", "The compute backend (always 1; see labels)",
                                 labels=["backend", "arch", "batch_invariant", "speculation"])
        info.add_metric([kernels["backend"], str(kernels["arch"] or ""), str(kernels["batch_invariant"]).lower(),
                         str(kernels["speculation"]).lower()], 1)
        yield info


def _vision_metrics(cache) -> Iterator:
    """The vision tower (zeros for a text model): images encoded, the tower's time, tower outputs kept."""
    yield _counter("conveyor_vision_images_encoded", "Images run through the vision tower (each distinct image "
                   "once while its output is kept)", cache.num_encoded if cache is not None else 0)
    yield _counter("conveyor_vision_encode_seconds", "Wall time of the vision tower, summed over images",
                   cache.encode_seconds if cache is not None else 0.0)
    yield _gauge("conveyor_vision_encoder_cache_images", "Vision tower outputs kept for reuse (by image hash)",
                 len(cache) if cache is not None else 0)


def _disk_tier_metrics(disk: dict | None) -> Iterator:
    """The prefix cache's disk tier (zeros without one, so dashboards need no special case)."""
    disk = disk or {}
    yield _gauge("conveyor_prompt_cache_disk_entries", "Prefix blocks stored on disk", disk.get("entries", 0))
    yield _gauge("conveyor_prompt_cache_disk_bytes", "Bytes of prefix block files on disk", disk.get("bytes", 0))
    yield _gauge("conveyor_prompt_cache_disk_budget_bytes", "Disk tier budget in bytes (0 = none or unbounded)",
                 disk.get("budget_bytes") or 0)
    yield _counter("conveyor_prompt_cache_disk_hits", "Prefix blocks read back from disk (at start or on a RAM miss)",
                   disk.get("hits", 0))
    yield _counter("conveyor_prompt_cache_disk_preloaded", "Of those, blocks read into RAM as the engine started",
                   disk.get("preloaded", 0))
    yield _counter("conveyor_prompt_cache_disk_hit_tokens", "Prompt tokens whose blocks came back from disk",
                   disk.get("hit_tokens", 0))
    yield _counter("conveyor_prompt_cache_disk_writes", "Prefix blocks written to disk", disk.get("writes", 0))
    yield _counter("conveyor_prompt_cache_disk_dropped", "Spills dropped because the writer's queue was full",
                   disk.get("dropped", 0))
    yield _counter("conveyor_prompt_cache_disk_rejected", "Block files ignored: another model or KV layout",
                   disk.get("rejected", 0))
    yield _counter("conveyor_prompt_cache_disk_corrupt", "Block files ignored: checksum, length or format wrong",
                   disk.get("corrupt", 0))
    yield _counter("conveyor_prompt_cache_disk_evictions", "Block files removed by the disk budget",
                   disk.get("evictions", 0))


def _batch_size_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """Exact per-step batch sizes, from the engine's own counts (no sampling)."""
    buckets = [(str(bound), sum(n for size, n in counts.items() if size <= bound)) for bound in _BATCH_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    return HistogramMetricFamily("conveyor_batch_size", "Sequences per engine step", buckets=buckets,
                                 sum_value=sum(size * n for size, n in counts.items()))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


@dataclass
class RequestTiming:
    """Per engine request: when it arrived and when its last token arrived."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None


# The wire APIs a request can arrive through (the `api` label of conveyor_api_requests).
WIRE_APIS = ("chat_completions", "completions", "messages", "responses", "embeddings", "rerank", "score")


def api_requests_counter(registry: CollectorRegistry) -> Counter:
    """Requests received per wire API, counted before validation (a node's and the router's)."""
    counter = Counter("conveyor_api_requests", "HTTP requests received, by wire API", ["api"], registry=registry)
    for api in WIRE_APIS:
        counter.labels(api)  # every series from zero
    return counter


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.ttft = Histogram("conveyor_time_to_first_token_seconds", "Arrival at the server to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("conveyor_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("conveyor_e2e_request_latency_seconds", "Arrival at the server to the last delta",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.rejected = Counter("conveyor_requests_rejected", "Requests refused before admission, by reason",
                                ["reason"], registry=self.registry)
        for reason in ("overloaded", "shutting_down", "engine_dead"):
            self.rejected.labels(reason)
        self.api_requests = api_requests_counter(self.registry)

    def observe(self, timing: RequestTiming, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if timing.first_token is None:
                timing.first_token = now
                self.ttft.observe(now - timing.arrival)
            else:
                self.itl.observe((now - timing.last_token) / len(out.new_token_ids))  # type: ignore[operator]
            timing.last_token = now
        if out.finished:
            self.e2e.observe(now - timing.arrival)

    def ttft_totals(self) -> tuple[float, float]:
        """(sum of seconds, count) of the TTFT histogram, for rates over an interval (the dashboard)."""
        return histogram_totals(self.ttft)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def histogram_totals(histogram: Histogram, **labels: str) -> tuple[float, float]:
    """A prometheus Histogram's (sum, count), read through its public collect(): summed over its label sets,
    or over those matching `labels` (a router's per-model series)."""
    total, count = 0.0, 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if any(sample.labels.get(key) != value for key, value in labels.items()):
                continue
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count
