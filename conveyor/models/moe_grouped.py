"""A MoE layer's routed experts on the quantized kernel in one GEMM call per projection (qgemm.linear_grouped).

The per-expert loop makes two GEMM calls and an activation per expert hit: at 16 decode rows (GPT-OSS-20B's
shape) most experts hit get 1-4 rows, ~50 small calls a layer (measured), each paying slicing and thread start-up.
Here the rows, already grouped by expert, go through every expert's first projection in one call, the
activation once over all of them, then every expert's down projection in one call.

Bits: the kernel gives each row what `linear` gives it on its expert's rows alone, and the activations are
elementwise per row, so a row's output is the loop's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.models.layers import RowInvariantLinear


@dataclass(frozen=True)
class _GroupedProjection:
    """One projection of every expert: one packed weight each, one GGML type and shape."""

    qtype: int
    in_features: int
    out_features: int
    packed: list[torch.Tensor]
    bias_f32: list[torch.Tensor | None]  # [] where no expert has a bias

    def __call__(self, ops: KernelBackend, x: torch.Tensor, offsets: list[int]) -> torch.Tensor:  # (A, in) -> (A, out)
        return ops.quantized_linear_grouped(x, self.packed, self.qtype, self.out_features, self.in_features,
                                            offsets, self.bias_f32)


def _group(linears: list[RowInvariantLinear]) -> _GroupedProjection | None:
    """The linears as one grouped projection, or None unless each is one quantized segment of one type and shape."""
    first = linears[0]
    if not all(len(linear.segments) == 1 for linear in linears):
        return None
    segments = [linear.segments[0] for linear in linears]
    if any(s.qtype != segments[0].qtype or s.rows != first.out_features or linear.out_features != first.out_features
           or linear.in_features != first.in_features for s, linear in zip(segments, linears)):
        return None
    biases = [s.bias_f32 for s in segments]
    return _GroupedProjection(segments[0].qtype, first.in_features, first.out_features, [s.packed for s in segments],
                              biases if any(b is not None for b in biases) else [])


@dataclass(frozen=True)
class GroupedExperts:
    """Every routed expert's first projection (gate|up, or up for relu^2), activation and down projection."""

    ops: KernelBackend
    first: _GroupedProjection
    down: _GroupedProjection
    activate: Callable[[torch.Tensor], torch.Tensor]  # the experts' own `activate` (they share one)

    def __call__(self, inputs: torch.Tensor, counts: list[int]) -> torch.Tensor:  # (A, H) grouped -> (A, H)
        """`inputs`: the assignments' rows grouped by expert, `counts[e]` rows for expert e."""
        offsets = list(accumulate(counts, initial=0))
        hidden = self.first(self.ops, inputs, offsets)  # (A, 2I) or (A, I)
        return self.down(self.ops, self.activate(hidden), offsets)


def group_experts(experts: nn.ModuleList, ops: KernelBackend) -> GroupedExperts | None:
    """The experts as GroupedExperts where they all run quantized alike on the CPU kernel, else None (the loop)."""
    if ops.qgemm is None or ops.device != "cpu":
        return None
    first = _group([expert.input_proj for expert in experts])
    down = _group([expert.down_proj for expert in experts])
    if first is None or down is None:
        return None
    return GroupedExperts(ops, first, down, experts[0].activate)
