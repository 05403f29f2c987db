"""The registry's policy on fake models (no engine): load on demand, LRU unload under --models-max and the
memory budget, pins, busy models kept, contention policies, failed loads, explicit load and unload."""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager

import pytest
from fastapi import FastAPI

from conveyor.config import EngineConfig, ServerConfig
from conveyor.server.multimodel.catalog import ModelSpec
from conveyor.server.multimodel.registry import LoadedModel, ModelRegistry, ModelState, ModelUnavailable

MIB = 1 << 20


class FakeModels:
    """load_model for the registry: an app whose lifespan records start/stop; sizes by name; loads that can
    be held (gate) or made to fail."""

    def __init__(self, sizes: dict[str, int], failing: set[str] = frozenset()) -> None:
        self.sizes, self.failing = sizes, set(failing)
        self.running: set[str] = set()
        self.loads: list[str] = []
        self.quiet: list[bool] = []
        self.events: list[tuple[str, str]] = []  # suspend / resume, in order
        self.gate: threading.Event | None = None

    def __call__(self, spec: ModelSpec, progress, quiet: bool) -> LoadedModel:
        if self.gate is not None:
            assert self.gate.wait(30)
        if spec.name in self.failing:
            raise RuntimeError(f"cannot read {spec.source}")
        self.loads.append(spec.name)
        self.quiet.append(quiet)

        @asynccontextmanager
        async def lifespan(app):
            self.running.add(spec.name)
            yield
            self.running.discard(spec.name)

        size = self.sizes[spec.name]
        memory = {"weights": size, "kv_cache": 0, "state": 0, "total": size}

        async def suspend() -> None:
            self.events.append(("suspend", spec.name))

        def resume(progress, quiet: bool) -> dict[str, int]:
            self.events.append(("resume", spec.name))
            return memory

        return LoadedModel(FastAPI(lifespan=lifespan), memory, suspend=suspend, resume=resume)


def _specs(*names: str, pinned: tuple[str, ...] = (), contention: dict[str, str] | None = None) -> list[ModelSpec]:
    return [ModelSpec(n, f"/nowhere/{n}.gguf", EngineConfig(model=f"/nowhere/{n}.gguf"), ServerConfig(served_model_name=n),
                      pinned=n in pinned, contention=(contention or {}).get(n)) for n in names]


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def _states(registry: ModelRegistry) -> dict[str, str]:
    return {name: e.state.value for name, e in registry.entries.items()}


async def _use(registry: ModelRegistry, name: str) -> None:
    async with registry.lease(name):
        pass


async def _settle(registry: ModelRegistry) -> None:
    """Until no load or unload is under way."""
    while any(e.state in (ModelState.LOADING, ModelState.UNLOADING) for e in registry.entries.values()):
        await registry._wait_change(None)


def test_least_recently_used_idle_model_is_unloaded_at_models_max():
    fake = FakeModels({"a": MIB, "b": MIB, "c": MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b", "c"), fake, max_loaded=2)
        await _use(registry, "a")
        await _use(registry, "b")
        await _use(registry, "a")  # b is now the least recently used
        await _use(registry, "c")
        await _settle(registry)
        assert _states(registry) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert registry.entries["b"].unloads["evicted"] == 1
        assert fake.running == {"a", "c"}  # b's app really stopped
        await registry.close()
        assert fake.running == set()

    _run(go())


def test_memory_budget_unloads_until_the_new_model_fits():
    fake = FakeModels({"a": 4 * MIB, "b": 4 * MIB, "c": 6 * MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b", "c"), fake, memory_budget=10 * MIB, max_loaded=8)
        for name in ("a", "b"):
            registry.entries[name].estimate_bytes = 4 * MIB
        registry.entries["c"].estimate_bytes = 6 * MIB
        await _use(registry, "a")
        await _use(registry, "b")
        assert registry.used_bytes == 8 * MIB
        await _use(registry, "c")  # 8 + 6 > 10: a (least recent) goes; 4 + 6 fits
        await _settle(registry)
        assert _states(registry) == {"a": "unloaded", "b": "loaded", "c": "loaded"}
        assert registry.used_bytes == 10 * MIB
        await registry.close()

    _run(go())


def test_a_model_measured_bigger_than_its_files_unloads_idle_models_after_its_load():
    fake = FakeModels({"a": 4 * MIB, "b": 8 * MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b"), fake, memory_budget=10 * MIB, max_loaded=8)
        registry.entries["a"].estimate_bytes = 4 * MIB
        registry.entries["b"].estimate_bytes = 1 * MIB  # its files said 1 MiB; it holds 8
        await _use(registry, "a")
        await _use(registry, "b")
        await _settle(registry)
        assert _states(registry) == {"a": "unloaded", "b": "loaded"}
        assert registry.entries["b"].estimate_bytes == 8 * MIB  # measured from now on
        await registry.close()

    _run(go())


def test_busy_and_pinned_models_are_never_unloaded_and_fail_policy_answers_503():
    fake = FakeModels({"a": MIB, "b": MIB, "c": MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b", "c", pinned=("a",)), fake, max_loaded=2, contention="fail")
        registry.start()  # a is pinned: loaded at start
        while registry.entries["a"].state is not ModelState.LOADED:
            await registry._wait_change(None)
        async with registry.lease("b"):  # b busy, a pinned: no room for c
            with pytest.raises(ModelUnavailable) as refused:
                await registry.acquire("c")
            assert refused.value.status == 503 and refused.value.code == "model_busy"
            assert refused.value.retry_after is not None
        await _use(registry, "c")  # b idle now: it goes, never a
        await _settle(registry)
        assert _states(registry) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert registry.contention_outcomes[("c", "failed")] == 1
        await registry.close()

    _run(go())


def test_wait_policy_loads_once_a_model_goes_idle():
    fake = FakeModels({"a": MIB, "b": MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b"), fake, max_loaded=1, contention="wait")
        held = await registry.acquire("a")
        waiter = asyncio.ensure_future(registry.acquire("b"))
        while registry.contention_outcomes[("b", "waited")] == 0:
            await asyncio.sleep(0.01)
        assert not waiter.done() and registry.entries["b"].state is ModelState.UNLOADED
        registry.release(held)
        entry = await waiter
        assert entry.name == "b" and _states(registry) == {"a": "unloaded", "b": "loaded"}
        registry.release(entry)
        await registry.close()

    _run(go())


def test_wait_then_fail_answers_503_after_the_timeout():
    fake = FakeModels({"a": MIB, "b": MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b"), fake, max_loaded=1, contention="fail", wait_timeout=0.05)
        registry.entries["b"].spec = _specs("b", contention={"b": "wait_then_fail"})[0]  # the preset's policy wins
        held = await registry.acquire("a")
        with pytest.raises(ModelUnavailable) as refused:
            await registry.acquire("b")
        assert refused.value.status == 503 and "--models-wait-timeout" in refused.value.message
        assert registry.contention_outcomes[("b", "timed_out")] == 1
        registry.release(held)
        await registry.close()

    _run(go())


def test_a_model_larger_than_the_budget_is_refused_at_once():
    fake = FakeModels({"a": MIB, "big": 64 * MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "big"), fake, memory_budget=8 * MIB, contention="wait")
        registry.entries["big"].estimate_bytes = 64 * MIB
        with pytest.raises(ModelUnavailable) as refused:
            await registry.acquire("big")
        assert refused.value.code == "model_too_large" and "--models-memory-budget" in refused.value.message
        await registry.close()

    _run(go())


def test_a_failed_load_answers_its_waiters_and_a_later_request_tries_again():
    fake = FakeModels({"a": MIB}, failing={"a"})

    async def go():
        registry = ModelRegistry(_specs("a"), fake)
        waiters = [asyncio.ensure_future(registry.acquire("a")) for _ in range(3)]
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, ModelUnavailable) and r.code == "model_load_failed" and "cannot read" in r.message
                   for r in results)
        assert registry.entries["a"].state is ModelState.FAILED and registry.entries["a"].num_load_failures == 1
        fake.failing.clear()
        await _use(registry, "a")
        assert registry.entries["a"].state is ModelState.LOADED
        await registry.close()

    _run(go())


def test_concurrent_requests_for_one_unloaded_model_load_it_once():
    fake = FakeModels({"a": MIB})
    fake.gate = threading.Event()

    async def go():
        registry = ModelRegistry(_specs("a"), fake)
        waiters = [asyncio.ensure_future(registry.acquire("a")) for _ in range(8)]
        while registry.entries["a"].state is not ModelState.LOADING:
            await asyncio.sleep(0.01)
        fake.gate.set()
        entries = await asyncio.gather(*waiters)
        assert fake.loads == ["a"] and registry.entries["a"].num_active == 8
        for entry in entries:
            registry.release(entry)
        await registry.close()

    _run(go())


def test_unload_waits_for_running_requests_and_new_ones_reload():
    fake = FakeModels({"a": MIB})

    async def go():
        registry = ModelRegistry(_specs("a"), fake)
        held = await registry.acquire("a")
        unloading = asyncio.ensure_future(registry.unload("a"))
        while registry.entries["a"].state is not ModelState.UNLOADING:
            await asyncio.sleep(0.01)
        assert "a" in fake.running  # still serving its request
        registry.release(held)
        await unloading
        assert registry.entries["a"].state is ModelState.UNLOADED and fake.running == set()
        assert registry.entries["a"].unloads["requested"] == 1
        await _use(registry, "a")  # comes back on demand
        assert fake.loads == ["a", "a"]
        await registry.close()

    _run(go())


def test_without_autoload_only_an_explicit_load_loads():
    fake = FakeModels({"a": MIB})

    async def go():
        registry = ModelRegistry(_specs("a"), fake, autoload=False)
        with pytest.raises(ModelUnavailable) as refused:
            await registry.acquire("a")
        assert refused.value.status == 400 and "/models/load" in refused.value.message
        await registry.load("a")
        await _use(registry, "a")
        await registry.close()

    _run(go())


def test_an_unknown_model_is_a_404_naming_the_served_ones():
    async def go():
        registry = ModelRegistry(_specs("a", "b"), FakeModels({}))
        with pytest.raises(ModelUnavailable) as refused:
            await registry.acquire("gpt-5")
        assert refused.value.status == 404 and "a, b" in refused.value.message

    _run(go())


def test_a_load_is_quiet_only_while_another_model_serves_requests():
    fake = FakeModels({"a": MIB, "b": MIB, "c": MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b", "c"), fake)
        await _use(registry, "a")
        async with registry.lease("a"):
            await _use(registry, "b")  # a streams meanwhile: b loads on one thread
        await _use(registry, "c")
        assert fake.quiet == [False, True, False]
        await registry.close()

    _run(go())


def test_preempt_suspends_the_least_recently_used_busy_model_which_returns_for_its_parked_requests():
    fake = FakeModels({"a": MIB, "b": MIB, "c": MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b", "c"), fake, max_loaded=2, contention="preempt")
        held_a = await registry.acquire("a")
        held_b = await registry.acquire("b")
        registry.entries["a"].last_used = 0.0  # a is the least recently used
        held_c = await registry.acquire("c")  # both busy: a is suspended, its request parked
        assert fake.events == [("suspend", "a")]
        assert registry.entries["a"].state is ModelState.SUSPENDED and registry.entries["a"].num_active == 1
        assert registry.entries["a"].unloads["preempted"] == 1 and registry.used_bytes == 2 * MIB
        assert registry.contention_outcomes[("c", "preempted")] == 1
        registry.release(held_c)  # c idle: a comes back in its place (c unloaded), a's request goes on
        while registry.entries["a"].state is not ModelState.LOADED:
            await registry._wait_change(None)
        assert fake.events == [("suspend", "a"), ("resume", "a")]
        await _settle(registry)
        assert _states(registry) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        registry.release(held_a)
        registry.release(held_b)
        await registry.close()

    _run(go())


def test_a_preempted_model_whose_requests_all_left_is_unloaded_not_resumed():
    fake = FakeModels({"a": MIB, "b": MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b"), fake, max_loaded=1, contention="preempt")
        held_a = await registry.acquire("a")
        held_b = await registry.acquire("b")
        registry.release(held_a)  # its client left while it was suspended
        await _settle(registry)
        while registry.entries["a"].state is not ModelState.UNLOADED:
            await registry._wait_change(None)
        assert ("resume", "a") not in fake.events and "a" not in fake.running
        registry.release(held_b)
        await registry.close()

    _run(go())


def test_wait_then_preempt_waits_first_and_pinned_busy_models_are_never_preempted():
    fake = FakeModels({"a": MIB, "b": MIB, "p": MIB})

    async def go():
        registry = ModelRegistry(_specs("a", "b", "p", pinned=("p",)), fake, max_loaded=1,
                                 contention="wait_then_preempt", wait_timeout=0.05)
        held_p = await registry.acquire("p")
        with pytest.raises(ModelUnavailable, match="none can be preempted"):
            await registry.acquire("a")
        assert registry.contention_outcomes[("a", "waited")] == 1 and not fake.events
        registry.release(held_p)
        registry.entries["p"].spec = _specs("p")[0]  # unpinned now
        held_p = await registry.acquire("p")
        held_a = await registry.acquire("a")  # waited 0.05 s, then preempted p
        assert fake.events == [("suspend", "p")]
        registry.release(held_a)
        registry.release(held_p)
        await registry.close()

    _run(go())
