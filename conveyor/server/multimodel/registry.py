"""The models of a multi-model server and their lifecycle: load on demand, unload the least recently used
idle one to make room, under one memory budget and a cap on how many are loaded.

A model is UNLOADED -> LOADING -> LOADED -> UNLOADING -> UNLOADED (or FAILED when its load raised). Requests
hold a model through `lease()`: a model with requests in flight is never unloaded; an unload asked for
(POST /models/unload) lets them finish first while new requests wait for it to come back. Under the
preempt policies a busy model is suspended instead (LOADED -> SUSPENDING -> SUSPENDED): its memory is
freed while its requests wait, parked with their streams open, and it comes back (LOADING -> LOADED,
the requests going on bitwise where they stopped) as soon as room frees without preempting anyone. Everything here
runs on the server's event loop; only the load itself (`load_model`, seconds of file reading and packing)
runs on a thread of its own, so the models already loaded keep streaming.

Memory is what each loaded model holds as allocated (EngineCore.memory_report: weights as kept, the KV pool
as reserved, recurrent state). Before a model's first load only its files' size is known; when its measured
size then passes the budget, idle models are unloaded right after.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.compute_share import ComputeShare
from conveyor.engine.load_progress import LoadProgress
from conveyor.loading.heap import trim_heap
from conveyor.server.deferred import on_daemon_thread
from conveyor.server.errors import APIError
from conveyor.server.multimodel.catalog import ModelSpec, source_bytes

logger = logging.getLogger(__name__)


class _Room(enum.Enum):
    LOADING = "the load started"
    MAKING = "models are unloading to make room"
    NONE = "no room now: every model that could go is busy"


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    SUSPENDING = "suspending"  # preempted: its requests are being parked, its memory freed
    SUSPENDED = "suspended"  # preempted: memory freed, requests parked until it comes back
    FAILED = "failed"


@dataclass
class LoadedModel:
    """What a load returns: the model's own ASGI app (routes, engine; its lifespan not yet entered) and
    the bytes it holds."""

    app: Any
    memory: dict[str, int]  # weights, kv_cache, state, total
    # Preemption (None: the model cannot be preempted): free the model keeping its requests parked, and build
    # it again (blocking, on a loading thread: (progress, quiet) -> the memory it then holds).
    suspend: Callable[[], Awaitable[None]] | None = None
    resume: Callable[[LoadProgress, bool], dict[str, int]] | None = None


# (spec, progress, quiet): quiet while other models serve requests (load on one thread, leave them the cores).
LoadModel = Callable[[ModelSpec, LoadProgress, bool], LoadedModel]


class ModelUnavailable(APIError):
    """A request's model cannot serve it now (or ever): answered as it is, in the called API's shape."""

    def __init__(self, status: int, message: str, code: str, retry_after: float | None = None) -> None:
        headers = {"Retry-After": str(max(int(retry_after), 1))} if retry_after is not None else None
        kind = "invalid_request_error" if status < 500 else "unavailable"
        super().__init__(status, message, kind, "model", code, headers)
        self.retry_after = retry_after


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    app: Any = None
    memory: dict[str, int] = field(default_factory=dict)
    estimate_bytes: int = 0  # its files' size until measured, then its last measured total
    num_active: int = 0  # requests holding it
    last_used: float = 0.0
    progress: LoadProgress | None = None
    error: str | None = None
    num_loads: int = 0
    num_load_failures: int = 0
    unloads: Counter = field(default_factory=Counter)  # by reason: evicted, requested, shutdown
    load_seconds: float | None = None
    stack: AsyncExitStack | None = None
    loaded: LoadedModel | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def resident_bytes(self) -> int:
        """What it holds or is about to: measured once loaded, the estimate while loading, 0 otherwise."""
        if self.state in (ModelState.LOADED, ModelState.UNLOADING, ModelState.SUSPENDING):
            return self.memory.get("total", self.estimate_bytes)
        return self.estimate_bytes if self.state is ModelState.LOADING else 0

    @property
    def holds_memory(self) -> bool:
        return self.state in (ModelState.LOADING, ModelState.LOADED, ModelState.UNLOADING, ModelState.SUSPENDING)

    @property
    def leaving(self) -> bool:
        """Its memory is on the way out (unloading or being suspended)."""
        return self.state in (ModelState.UNLOADING, ModelState.SUSPENDING)


class ModelRegistry:
    def __init__(self, specs: list[ModelSpec], load_model: LoadModel, *, memory_budget: int | None = None,
                 max_loaded: int = 4, autoload: bool = True, contention: str = "wait_then_fail",
                 wait_timeout: float = 60.0, show_progress: bool | None = None,
                 compute_share: ComputeShare | None = None) -> None:
        """compute_share: the engines' turns on the cores, which the loader gives each engine (its counters
        are in /metrics)."""
        self.entries = {spec.name: ModelEntry(spec, estimate_bytes=source_bytes(spec.source)) for spec in specs}
        self.default_name = specs[0].name  # a request that names no model
        self._load_model = load_model
        self.memory_budget = memory_budget
        self.max_loaded = max_loaded
        self.autoload = autoload
        self.contention = contention
        self.wait_timeout = wait_timeout
        self.show_progress = show_progress
        self.compute_share = compute_share
        self.contention_outcomes: Counter = Counter()  # (model, outcome): waited, failed, timed_out
        self.closing = False
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    # -- requests --------------------------------------------------------------------------------
    def entry(self, name: str) -> ModelEntry:
        entry = self.entries.get(name)
        if entry is None:
            names = ", ".join(self.entries)
            raise ModelUnavailable(404, f"The model '{name}' does not exist; this server serves: {names}",
                                   "model_not_found")
        return entry

    @asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[ModelEntry]:
        """The loaded model, held (never unloaded) until the block ends; loads it first when needed."""
        entry = await self.acquire(name)
        try:
            yield entry
        finally:
            self.release(entry)

    async def acquire(self, name: str, explicit: bool = False) -> ModelEntry:
        """Wait until `name` is loaded and hold it. explicit: asked by POST /models/load (loads even when
        --no-models-autoload)."""
        entry = self.entry(name)
        failures_seen = entry.num_load_failures
        deadline: float | None = None
        while True:
            if self.closing:
                raise ModelUnavailable(503, "the server is shutting down", "unavailable")
            if entry.state is ModelState.LOADED:
                entry.num_active += 1
                entry.last_used = time.monotonic()
                return entry
            if entry.state is ModelState.FAILED and entry.num_load_failures > failures_seen:
                raise ModelUnavailable(503, f"the model '{name}' did not load: {entry.error}", "model_load_failed")
            deadline_now: float | None = None  # loads and unloads end by themselves: waited without a bound
            if entry.state in (ModelState.UNLOADED, ModelState.FAILED):
                if not (self.autoload or explicit):
                    raise ModelUnavailable(
                        400, f"the model '{name}' is not loaded and this server loads models only when asked "
                             "(--no-models-autoload): POST /models/load {\"model\": \"" + name + "\"}",
                        "model_not_loaded")
                step = self._make_room(entry)
                if step is _Room.LOADING:
                    continue
                if step is _Room.NONE:
                    deadline = deadline_now = self._contention(entry, deadline)
                    if deadline_now is not None and deadline_now <= time.monotonic():
                        continue  # wait_then_preempt's wait is over: preempting made room (or refused)
            if not await self._wait_change(deadline_now):
                if self._policy(entry) == "wait_then_preempt":
                    deadline = time.monotonic()  # next round preempts
                    continue
                self.contention_outcomes[(name, "timed_out")] += 1
                raise ModelUnavailable(503, f"no room to load the model '{name}': every loaded model stayed busy "
                                            f"for {self.wait_timeout:g} s (--models-wait-timeout)",
                                       "model_busy", retry_after=self.wait_timeout)

    def release(self, entry: ModelEntry) -> None:
        entry.num_active -= 1
        entry.last_used = time.monotonic()
        self._notify()

    # -- explicit load and unload (POST /models/load, /models/unload) -----------------------------
    async def load(self, name: str) -> ModelEntry:
        entry = await self.acquire(name, explicit=True)
        self.release(entry)
        return entry

    async def unload(self, name: str, reason: str = "requested") -> None:
        """Unload once its running requests end (new ones wait for it to come back)."""
        entry = self.entry(name)
        while entry.state is ModelState.LOADING:
            await self._wait_change(None)
        if entry.state is ModelState.LOADED:
            self._begin_unload(entry, reason)
        while entry.state in (ModelState.UNLOADING, ModelState.SUSPENDING):
            await self._wait_change(None)

    # -- start and stop ---------------------------------------------------------------------------
    def start(self) -> None:
        """Load the pinned and load-on-startup models (in the background; requests for them wait)."""
        for entry in self.entries.values():
            if entry.spec.starts_loaded:
                self._spawn(self._load_at_start(entry))

    async def close(self) -> None:
        self.closing = True
        self._notify()
        while any(e.state in (ModelState.LOADING, ModelState.SUSPENDING) for e in self.entries.values()):
            await self._wait_change(None)
        for entry in self.entries.values():
            if entry.state is ModelState.LOADED:
                self._begin_unload(entry, "shutdown")
            elif entry.state is ModelState.SUSPENDED:  # its parked requests end now, with an abort
                self._begin_unload(entry, "shutdown", wait_for_requests=False)
        while any(e.state is ModelState.UNLOADING for e in self.entries.values()):
            await self._wait_change(None)

    # -- room ---------------------------------------------------------------------------------------
    def _make_room(self, entry: ModelEntry) -> _Room:
        """Start loading `entry`, or start unloading idle models so that it fits."""
        self._check_fits_at_all(entry)
        others = [e for e in self.entries.values() if e.holds_memory and e is not entry]
        leaving = [e for e in others if e.leaving]
        staying = [e for e in others if not e.leaving]
        used, count = sum(e.resident_bytes for e in staying), len(staying)
        idle = sorted((e for e in staying if e.state is ModelState.LOADED and not e.num_active and not e.spec.pinned),
                      key=lambda e: e.last_used)
        victims = []
        while not self._fits(used, count, entry.estimate_bytes):
            if not idle:
                return _Room.MAKING if leaving else _Room.NONE
            victim = idle.pop(0)
            victims.append(victim)
            used, count = used - victim.resident_bytes, count - 1
        for victim in victims:
            self._begin_unload(victim, "evicted")
        if victims or (leaving and not self._fits(used + sum(e.resident_bytes for e in leaving),
                                                  count + len(leaving), entry.estimate_bytes)):
            return _Room.MAKING  # load once what leaves has left (its memory is still held)
        self._begin_load(entry)
        return _Room.LOADING

    def _fits(self, used: int, count: int, need: int) -> bool:
        if count + 1 > self.max_loaded:
            return False
        return self.memory_budget is None or used + need <= self.memory_budget

    def _check_fits_at_all(self, entry: ModelEntry) -> None:
        """A model that cannot fit even with every unpinned model unloaded is refused, not waited for."""
        if self.memory_budget is None:
            return
        pinned = sum(e.resident_bytes for e in self.entries.values() if e.spec.pinned and e is not entry)
        if pinned + entry.estimate_bytes > self.memory_budget:
            raise ModelUnavailable(
                503, f"the model '{entry.name}' needs {entry.estimate_bytes / 2**20:.0f} MiB, more than "
                     f"--models-memory-budget ({self.memory_budget / 2**20:.0f} MiB) leaves beside the pinned "
                     f"models ({pinned / 2**20:.0f} MiB)", "model_too_large")

    def _policy(self, entry: ModelEntry) -> str:
        return entry.spec.contention or self.contention

    def _contention(self, entry: ModelEntry, deadline: float | None) -> float | None:
        """Every loaded model that could make room is busy: the policy (the model's preset, else
        --models-contention) decides. Returns the deadline to wait until (None: no bound)."""
        policy = self._policy(entry)
        busy = ", ".join(e.name for e in self.entries.values() if e.holds_memory)
        preempt_now = policy == "preempt" or (policy == "wait_then_preempt" and deadline is not None
                                              and deadline <= time.monotonic())
        if preempt_now:
            if self._preempt_for(entry):
                self.contention_outcomes[(entry.name, "preempted")] += 1
                return None  # the victims are being suspended: wait for them
            raise ModelUnavailable(503, f"no room to load the model '{entry.name}': the loaded models ({busy}) are "
                                        "busy and none can be preempted (pinned)", "model_busy", retry_after=1.0)
        if policy == "fail":
            self.contention_outcomes[(entry.name, "failed")] += 1
            raise ModelUnavailable(503, f"no room to load the model '{entry.name}': the loaded models ({busy}) "
                                        "are all serving requests (--models-contention fail)", "model_busy",
                                   retry_after=1.0)
        if deadline is None:
            self.contention_outcomes[(entry.name, "waited")] += 1
            if policy in ("wait_then_fail", "wait_then_preempt"):
                deadline = time.monotonic() + self.wait_timeout
        return deadline

    def _preempt_for(self, entry: ModelEntry) -> bool:
        """Suspend the least recently used busy models (unpinned, preemptible) until `entry` fits; False when
        even all of them would not make room."""
        staying = [e for e in self.entries.values() if e.holds_memory and not e.leaving and e is not entry]
        used, count = sum(e.resident_bytes for e in staying), len(staying)
        candidates = sorted((e for e in staying if e.state is ModelState.LOADED and not e.spec.pinned
                             and e.loaded is not None and e.loaded.suspend is not None), key=lambda e: e.last_used)
        victims = []
        while not self._fits(used, count, entry.estimate_bytes):
            if not candidates:
                return False
            victim = candidates.pop(0)
            victims.append(victim)
            used, count = used - victim.resident_bytes, count - 1
        for victim in victims:
            self._begin_suspend(victim)
        return True

    # -- transitions ------------------------------------------------------------------------------
    def _begin_load(self, entry: ModelEntry) -> None:
        resuming = entry.state is ModelState.SUSPENDED
        entry.state, entry.error = ModelState.LOADING, None
        entry.progress = LoadProgress(show_bar=self.show_progress)
        self._notify()
        self._spawn(self._resume(entry) if resuming else self._load(entry))

    async def _load(self, entry: ModelEntry) -> None:
        started = time.monotonic()
        quiet = any(e.num_active for e in self.entries.values() if e is not entry)
        try:
            loaded = await on_daemon_thread(lambda: self._load_model(entry.spec, entry.progress, quiet), f"conveyor-load-{entry.name}")
            stack = AsyncExitStack()
            await stack.enter_async_context(loaded.app.router.lifespan_context(loaded.app))
        except Exception as exc:
            logger.error("model %s did not load: %s", entry.name, exc)
            entry.state, entry.error = ModelState.FAILED, str(exc)
            entry.num_load_failures += 1
            self._notify()
            return
        entry.app, entry.memory, entry.stack, entry.loaded = loaded.app, loaded.memory, stack, loaded
        entry.estimate_bytes = loaded.memory["total"]
        entry.state, entry.load_seconds = ModelState.LOADED, time.monotonic() - started
        entry.num_loads += 1
        entry.last_used = time.monotonic()
        entry.progress.finish()
        logger.info("model %s loaded in %.1f s (%.0f MiB)", entry.name, entry.load_seconds,
                    entry.memory["total"] / 2**20)
        self._notify()
        self._trim_after_load(entry)

    def _trim_after_load(self, loaded: ModelEntry) -> None:
        """Measured bigger than its files said: unload idle models until the budget holds again."""
        if self.memory_budget is None:
            return
        used = sum(e.resident_bytes for e in self.entries.values() if e.holds_memory and not e.leaving)
        idle = sorted((e for e in self.entries.values() if e.state is ModelState.LOADED and e is not loaded
                       and not e.num_active and not e.spec.pinned), key=lambda e: e.last_used)
        while used > self.memory_budget and idle:
            victim = idle.pop(0)
            used -= victim.resident_bytes
            self._begin_unload(victim, "evicted")
        if used > self.memory_budget:
            logger.warning("models hold %.0f MiB, over --models-memory-budget (%.0f MiB), until busy ones go idle",
                           used / 2**20, self.memory_budget / 2**20)

    def _begin_unload(self, entry: ModelEntry, reason: str, wait_for_requests: bool = True) -> None:
        entry.state = ModelState.UNLOADING
        self._notify()
        self._spawn(self._unload(entry, reason, wait_for_requests))

    async def _unload(self, entry: ModelEntry, reason: str, wait_for_requests: bool = True) -> None:
        while wait_for_requests and entry.num_active:  # its running requests finish first
            await self._wait_change(None)
        stack, entry.stack, entry.app, entry.loaded = entry.stack, None, None, None
        try:
            if stack is not None:
                await stack.aclose()  # the app's lifespan: the engine stops (and spills its prefix cache)
        except Exception:
            logger.exception("unloading model %s failed", entry.name)
        del stack
        await asyncio.to_thread(_give_memory_back)
        entry.state, entry.memory = ModelState.UNLOADED, {}
        entry.unloads[reason] += 1
        logger.info("model %s unloaded (%s)", entry.name, reason)
        self._notify()

    # -- preemption -----------------------------------------------------------------------------------
    def _begin_suspend(self, entry: ModelEntry) -> None:
        entry.state = ModelState.SUSPENDING
        self._notify()
        self._spawn(self._suspend(entry))

    async def _suspend(self, entry: ModelEntry) -> None:
        try:
            await entry.loaded.suspend()
        except Exception:
            logger.exception("suspending model %s failed: unloading it", entry.name)
            entry.state = ModelState.LOADED
            self._begin_unload(entry, "preempted", wait_for_requests=False)
            return
        await asyncio.to_thread(_give_memory_back)
        entry.state, entry.memory = ModelState.SUSPENDED, {}
        entry.unloads["preempted"] += 1
        logger.info("model %s preempted: %d request(s) parked until it comes back", entry.name, entry.num_active)
        self._notify()
        self._spawn(self._return_when_room(entry))

    async def _return_when_room(self, entry: ModelEntry) -> None:
        """A suspended model comes back as soon as it fits (unloading idle models, never preempting), or is
        unloaded once none of its parked requests is left (their clients left)."""
        while entry.state is ModelState.SUSPENDED and not self.closing:
            if not entry.num_active:
                self._begin_unload(entry, "preempted")
                return
            try:
                if self._make_room(entry) is _Room.LOADING:
                    return
            except ModelUnavailable:  # the pinned models grew meanwhile: it waits for room like the rest
                pass
            await self._wait_change(None)

    async def _resume(self, entry: ModelEntry) -> None:
        started = time.monotonic()
        quiet = any(e.num_active for e in self.entries.values() if e is not entry)
        try:
            memory = await on_daemon_thread(lambda: entry.loaded.resume(entry.progress, quiet), f"conveyor-resume-{entry.name}")
        except Exception as exc:
            logger.error("model %s did not come back: %s", entry.name, exc)
            entry.error = str(exc)
            entry.num_load_failures += 1
            self._begin_unload(entry, "preempted", wait_for_requests=False)  # its parked requests end (abort)
            return
        entry.memory, entry.estimate_bytes = memory, memory["total"]
        entry.state, entry.load_seconds = ModelState.LOADED, time.monotonic() - started
        entry.num_loads += 1
        entry.last_used = time.monotonic()
        entry.progress.finish()
        logger.info("model %s back in %.1f s; its parked requests go on", entry.name, entry.load_seconds)
        self._notify()
        self._trim_after_load(entry)

    async def _load_at_start(self, entry: ModelEntry) -> None:
        try:
            await self.load(entry.name)
        except ModelUnavailable as exc:
            logger.error("model %s was not loaded at start: %s", entry.name, exc.message)

    # -- plumbing ------------------------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, deadline: float | None) -> bool:
        """Until something changes (a load, an unload, a request ending); False when the deadline passed."""
        changed = self._changed
        if deadline is None:
            await changed.wait()
            return True
        try:
            await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0))
            return True
        except asyncio.TimeoutError:
            return False

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reports -------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(e.resident_bytes for e in self.entries.values() if e.holds_memory)

    @property
    def num_loaded(self) -> int:
        return sum(e.state is ModelState.LOADED for e in self.entries.values())

    def most_recent(self) -> ModelEntry | None:
        loaded = [e for e in self.entries.values() if e.state is ModelState.LOADED]
        return max(loaded, key=lambda e: e.last_used) if loaded else None


def _give_memory_back() -> None:
    _forget_fastapi_endpoints()
    gc.collect()  # the engine's cycles hold its tensors
    trim_heap()


def _forget_fastapi_endpoints() -> None:
    """FastAPI keeps the endpoint functions of every app it has seen in module-level LRU caches (4,096 entries
    in 0.165); ours close over their model's engine, so an unloaded model's weights stayed in memory (~0.7 GB
    a switch on a 1B). Clear them; tests/server/multimodel checks that an unloaded model's core is freed."""
    from fastapi.dependencies import models

    for name in dir(models):
        cache_clear = getattr(getattr(models, name), "cache_clear", None)
        if name.endswith("_cached") and callable(cache_clear):
            cache_clear()
