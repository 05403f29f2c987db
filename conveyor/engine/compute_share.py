"""Engines of one process taking turns on its cores, so background work cannot stretch streaming chats.

A multi-model server runs one engine thread per model, and each forward uses every intra-op thread (and
the kernels' pool). Two engines stepping at once oversubscribe the cores: measured on 2 vCPUs, a burst of
embeddings beside 4 streaming chats took the chats' inter-token p99 from 21 to 69 ms. Here the engines
take turns instead, each turn on all the cores:

- **Foreground** engines (generating models: someone watches their tokens) step freely among themselves.
- **Background** engines (embedders, rerankers: bulk prefill nobody watches token by token) step only
  while no foreground step runs, one at a time, in slices: between two layers of a forward the background
  steps aside as soon as a foreground step waits and its slice is used up. A slice is
  `share / (1 - share)` times a recent foreground step, so a chat's gap grows by about that fraction (plus
  one layer), and the background keeps about `share` of the time while chats run; all of it when none do.
- While a foreground engine is busy, a background step also takes fewer tokens (`token_cap`), so one of its
  layers stays within a slice: a layer cannot be split.

Turns never change what a forward computes, only when it runs: outputs stay bitwise the same.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

DEFAULT_BACKGROUND_SHARE = 0.33  # (--models-background-share: config.py)
_EMA = 0.2  # weight of the newest measurement in the running step times
# Fewest tokens a capped background step takes (below this its GEMMs lose more than the turns gain).
MIN_BACKGROUND_TOKENS = 16


@dataclass
class ComputeShareStats:
    foreground_steps: int = 0
    background_slices: int = 0
    background_yields: int = 0  # slices cut short between layers for a waiting foreground step


@dataclass
class BackgroundTurn:
    token_cap: int | None  # most tokens the step may take (None: no cap, no foreground engine was busy)
    tokens: int = 0  # tokens the step ran (its caller fills it in)


class ComputeShare:
    def __init__(self, background_share: float = DEFAULT_BACKGROUND_SHARE) -> None:
        if not 0 < background_share < 1:
            raise ValueError(f"background_share must be between 0 and 1, got {background_share}")
        self.background_share = background_share
        self.stats = ComputeShareStats()
        self._cond = threading.Condition()
        self._foreground_running = 0
        self._foreground_waiting = 0
        self._foreground_active: set[int] = set()  # engines with work, by id
        self._background_holder: int | None = None  # thread ident
        self._background_waiting = 0
        self._background_turn = False  # True: a waiting background goes before waiting foreground steps
        self._slice_started = 0.0
        self._foreground_step_s: float | None = None  # running mean of a foreground step
        self._background_token_layer_s: float | None = None  # running mean of one token through one layer
        self._local = threading.local()

    # -- foreground ------------------------------------------------------------------------------------
    @contextmanager
    def foreground(self) -> Iterator[None]:
        """One foreground step: waits only for a background slice in progress (or owed)."""
        with self._cond:
            self._foreground_waiting += 1
            self._cond.wait_for(lambda: self._background_holder is None
                                and not (self._background_waiting and self._background_turn))
            self._foreground_waiting -= 1
            self._foreground_running += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            with self._cond:
                self._foreground_running -= 1
                self.stats.foreground_steps += 1
                self._foreground_step_s = _mean(self._foreground_step_s, elapsed)
                if self._background_waiting:
                    self._background_turn = True  # one turn each: the running steps drain, then a slice
                self._cond.notify_all()

    def set_foreground_active(self, engine: object, active: bool) -> None:
        """A foreground engine has work (requests streaming or waiting), or none: between its steps, too."""
        with self._cond:
            (self._foreground_active.add if active else self._foreground_active.discard)(id(engine))

    def foreground_threads(self, serving_threads: int) -> int:
        """Intra-op threads for a foreground step: with several foreground engines busy, each steps on its share
        of the cores at once instead of all of them stepping on every core (oversubscribed)."""
        return max(1, serving_threads // max(1, len(self._foreground_active)))

    def foreground_busy(self) -> bool:
        return bool(self._foreground_running or self._foreground_waiting or self._foreground_active)

    # -- background ------------------------------------------------------------------------------------
    @contextmanager
    def background(self, layers: int = 0) -> Iterator[BackgroundTurn]:
        """One background step through a model of `layers` layers: in slices, yielding between layers
        (yield_point) to waiting foreground steps. The step takes at most the turn's `token_cap` tokens (None:
        any number), and sets the turn's `tokens` to how many it ran."""
        self._acquire_background()
        turn = BackgroundTurn(token_cap=self.token_cap())
        local = self._local
        local.holding, local.held_s, local.layer_started, local.layer_s = True, 0.0, self._slice_started, 0.0
        try:
            yield turn
        finally:
            local.holding = False
            self._release_background()
            # Its rate per token and layer, measured on uncapped steps only: a capped step's small GEMMs run
            # slower per token, and sizing the cap from them would shrink it further each step.
            if turn.tokens and layers and turn.token_cap is None:
                self._background_token_layer_s = _mean(self._background_token_layer_s,
                                                       local.held_s / (turn.tokens * layers))

    def yield_point(self) -> None:
        """Before a layer of a background forward: step aside if a foreground step waits and this slice
        would run past its length with one more layer like the last one. A no-op on any other thread."""
        local = self._local
        if not getattr(local, "holding", False):
            return
        now = time.perf_counter()
        local.layer_s, local.layer_started = now - local.layer_started, now
        if not self._foreground_waiting or now - self._slice_started + local.layer_s <= self.slice_seconds():
            return
        self.stats.background_yields += 1
        self._release_background()
        self._acquire_background()
        local.layer_started = self._slice_started

    def slice_seconds(self) -> float:
        """How long a background slice may run while a foreground step waits."""
        if self._foreground_step_s is None:
            return 0.0
        return self._foreground_step_s * self.background_share / (1 - self.background_share)

    def token_cap(self) -> int | None:
        """Most tokens for the next background step (None: no cap, as when no foreground engine is busy):
        as many as one layer runs in a slice at the rate of uncapped steps."""
        if not self.foreground_busy() or self._background_token_layer_s is None:
            return None
        return max(MIN_BACKGROUND_TOKENS, round(self.slice_seconds() / self._background_token_layer_s))

    def _acquire_background(self) -> None:
        with self._cond:
            self._background_waiting += 1
            self._cond.wait_for(lambda: self._background_holder is None and not self._foreground_running
                                and not (self._foreground_waiting and not self._background_turn))
            self._background_waiting -= 1
            self._background_holder = threading.get_ident()
            self._slice_started = time.perf_counter()
            self.stats.background_slices += 1

    def _release_background(self) -> None:
        self._local.held_s = getattr(self._local, "held_s", 0.0) + time.perf_counter() - self._slice_started
        with self._cond:
            self._background_holder = None
            self._background_turn = False  # the foreground steps that waited go first
            self._cond.notify_all()


def _mean(current: float | None, sample: float) -> float:
    return sample if current is None else (1 - _EMA) * current + _EMA * sample


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model (every family keeps them in a ModuleList named `layers`)."""
    return [layer for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, nn.ModuleList) for layer in module]


def install_yield_points(model: nn.Module, share: ComputeShare) -> int:
    """A yield point before each layer of the model; returns how many layers got one."""
    layers = model_layers(model)
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: share.yield_point())
    return len(layers)
