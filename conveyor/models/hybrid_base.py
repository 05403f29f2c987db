"""What every hybrid mixer shares (models/hybrid.py, hybrid_mlp.py, mamba2_mixer.py): the forward's context and
the loading helpers.

A mixer is an nn.Module with `cache_index`, `cache_spec()` (KVSpec, StateSpec or None), `forward(x, ctx)`
and `load(get, prefix, names, loader, norm)`, where `names` is its entry of the family's NAMES.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata
from conveyor.models.llama import Rope
from conveyor.models.tensors import QuantizedTensor, Weight
from conveyor.models.weights import WeightLoader

Getter = Callable[[str], Weight]
NormGetter = Callable[[str], nn.Parameter]  # a norm's weight, with the family's offset folded in


@dataclass
class LayerContext:
    """What every mixer of a forward may read: rotary tables (None without rotary), every cache, the step's metadata."""

    rope: Rope | None
    caches: list
    meta: AttentionMetadata


def conv_weight(loader: WeightLoader, tensor: Weight) -> torch.Tensor:
    """A depthwise conv1d weight (C, 1, K) as the kernel's contiguous fp32 (C, K), rounded to the model dtype first."""
    weight = loader.dense(tensor)
    return weight.reshape(weight.shape[0], -1).float().contiguous()


def fp32_param(loader: WeightLoader, tensor: Weight) -> torch.Tensor:
    """A small per-head parameter (A_log, dt_bias, D, biases) as contiguous fp32 of its model-dtype value."""
    return loader.dense(tensor).float().contiguous()


def scaled(weight: Weight, scale: float | torch.Tensor) -> Weight:
    """weight * scale (a number, or one per output row) in fp32, so the model dtype rounds the product once:
    how Falcon-H1's multipliers fold into the weights they scale."""
    if not isinstance(scale, torch.Tensor) and scale == 1.0:
        return weight
    dense = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight.float()
    if isinstance(scale, torch.Tensor):
        scale = scale.view(-1, *([1] * (dense.dim() - 1)))
    return dense * scale
