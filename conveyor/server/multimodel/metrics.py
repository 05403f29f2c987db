"""/metrics of a multi-model server: the registry's own series (state, memory, loads, unloads, contention)
and every loaded model's series with a `model` label (a model's counters restart when it loads again)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from conveyor.server.multimodel.registry import ModelRegistry, ModelState


class ModelsCollector(Collector):
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def collect(self):
        registry = self.registry
        entries = list(registry.entries.values())
        yield GaugeMetricFamily("conveyor_models_loaded", "Models loaded now", value=registry.num_loaded)
        yield GaugeMetricFamily("conveyor_models_memory_used_bytes", "Bytes the loaded (and loading) models hold",
                                value=registry.used_bytes)
        if registry.memory_budget is not None:
            yield GaugeMetricFamily("conveyor_models_memory_budget_bytes", "--models-memory-budget",
                                    value=registry.memory_budget)
        state = GaugeMetricFamily("conveyor_model_state", "1 for the state each model is in", labels=["model", "state"])
        memory = GaugeMetricFamily("conveyor_model_memory_bytes", "Bytes a loaded model holds, by kind",
                                   labels=["model", "kind"])
        active = GaugeMetricFamily("conveyor_model_requests_in_flight", "Requests holding each model",
                                   labels=["model"])
        loads = CounterMetricFamily("conveyor_model_loads", "Loads completed", labels=["model"])
        failures = CounterMetricFamily("conveyor_model_load_failures", "Loads that raised", labels=["model"])
        unloads = CounterMetricFamily("conveyor_model_unloads", "Unloads, by reason (evicted: to make room; "
                                      "requested: POST /models/unload; preempted: suspended for a busy server's load; shutdown)", labels=["model", "reason"])
        seconds = GaugeMetricFamily("conveyor_model_load_seconds", "How long each model's last load took",
                                    labels=["model"])
        for entry in entries:
            for value in ModelState:
                state.add_metric([entry.name, value.value], int(entry.state is value))
            for kind, nbytes in entry.memory.items():
                memory.add_metric([entry.name, kind], nbytes)
            active.add_metric([entry.name], entry.num_active)
            loads.add_metric([entry.name], entry.num_loads)
            failures.add_metric([entry.name], entry.num_load_failures)
            for reason in ("evicted", "requested", "preempted", "shutdown"):
                unloads.add_metric([entry.name, reason], entry.unloads[reason])
            if entry.load_seconds is not None:
                seconds.add_metric([entry.name], entry.load_seconds)
        contention = CounterMetricFamily("conveyor_model_contention", "Requests that found no room to load their "
                                         "model, by outcome (waited, failed, timed_out, preempted)", labels=["model", "outcome"])
        for (name, outcome), count in sorted(registry.contention_outcomes.items()):
            contention.add_metric([name, outcome], count)
        yield from (state, memory, active, loads, failures, unloads, seconds, contention)
        share = registry.compute_share
        if share is not None:
            stats = share.stats
            yield CounterMetricFamily("conveyor_compute_share_foreground_steps", "Steps of generating models, "
                                      "taken in turns with pooling models (--models-background-share)",
                                      value=stats.foreground_steps)
            yield CounterMetricFamily("conveyor_compute_share_background_slices", "Slices of the cores pooling "
                                      "models ran in", value=stats.background_slices)
            yield CounterMetricFamily("conveyor_compute_share_background_yields", "Pooling models' forwards "
                                      "paused between layers for a waiting generating model's step",
                                      value=stats.background_yields)
        yield from _per_model_series(registry)


def _per_model_series(registry: ModelRegistry):
    """Each loaded model's own /metrics, its samples labelled with the model's name."""
    merged: dict[str, Metric] = {}
    for entry in list(registry.entries.values()):
        app = entry.app
        if entry.state is not ModelState.LOADED or app is None:
            continue
        for family in app.state.metrics.registry.collect():
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            into.samples += [Sample(s.name, {"model": entry.name, **s.labels}, s.value, s.timestamp, s.exemplar)
                             for s in family.samples]
    return merged.values()


class MultiModelMetrics:
    """The front's registry (a model's requests are counted by that model's own series)."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ModelsCollector(registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)
