"""What a model's layers keep between steps, as the runner allocates it and the engine budgets it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVSpec:
    """Attention: K and V per token, in the block pool (one block table for every such layer)."""

    num_kv_heads: int
    head_dim: int


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
