"""What a model's layers keep between steps, as the runner allocates it and the engine budgets it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVSpec:
    """Attention: K and V per token, in the block pool. `window` > 0: a sliding layer that reads only the last
    `window` positions, so its K/V may live in the sliding group's own blocks (see kv_window).

    `values_in_keys` (MLA, models/mla.py): the layer keeps one tensor of key rows and reads its values from
    them (the compressed latent is the first columns of each key row), so a token costs one row, not two."""

    num_kv_heads: int
    head_dim: int
    window: int = 0
    values_in_keys: bool = False

    @property
    def rows_per_token_head(self) -> int:
        """Cache rows one token keeps per KV head: K and V, or K alone when the values are read from it."""
        return 1 if self.values_in_keys else 2


@dataclass(frozen=True)
class StateSpec:
    """A recurrent mixer: fixed-size fp32 tensors per sequence (conv window, SSM / DeltaNet state),
    kept in state slots that a sequence holds from admission to finish."""

    shapes: tuple[tuple[int, ...], ...]

    @property
    def bytes_per_slot(self) -> int:
        return 4 * sum(math.prod(shape) for shape in self.shapes)


CacheSpec = KVSpec | StateSpec


def state_bytes_per_slot(specs: list[CacheSpec]) -> int:
    """Bytes one sequence's recurrent state costs over all layers (0 for a model without any)."""
    return sum(spec.bytes_per_slot for spec in specs if isinstance(spec, StateSpec))


def kv_layers(specs: list[CacheSpec]) -> list[KVSpec]:
    return [spec for spec in specs if isinstance(spec, KVSpec)]


def kv_window(specs: list[CacheSpec]) -> int:
    """The window of the sliding K/V group: 0 when every attention layer shares one block table (no sliding
    layer, or only sliding ones, which keep today's layout), else the largest window of the sliding layers
    (a layer with a shorter one reads a subset of what that group keeps)."""
    windows = {spec.window for spec in kv_layers(specs)}
    if 0 not in windows or len(windows) < 2:
        return 0
    return max(windows)


def has_latent_kv(specs: list[CacheSpec]) -> bool:
    """Whether some attention layer reads its values from its key rows (MLA): features that move K and V as
    two tensors per layer (q8_0 caches, the disk tier, the KV handoff) refuse such models at startup."""
    return any(spec.values_in_keys for spec in kv_layers(specs))


def in_window_group(spec: CacheSpec, window: int) -> bool:
    """Whether this attention layer's K/V lives in the sliding group (window: kv_window of the model)."""
    return window > 0 and isinstance(spec, KVSpec) and spec.window > 0
