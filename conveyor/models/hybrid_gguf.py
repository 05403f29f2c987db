"""What llama.cpp's hybrid GGUFs share (lfm2.py, qwen3_5.py and qwen3_next.py register theirs): config helpers for
their `gguf_fields`, and `HybridTensors`, their `gguf_weights`.

HybridTensors renames one file's tensors to the Hugging Face names transformers' save_pretrained writes, from the
family's tables, splits an attention layer's q|k|v fused by convert_hf_to_gguf --fuse-qkv and gives a depthwise
conv squeezed to (C, K) back its (C, 1, K); a family's subclass undoes the rest. Experts (stacked ffn_*_exps) are
split per expert by the loader, as for the other MoE families; llama.cpp renormalises their top-k weights and
scales them by nothing (LFM2-MoE's routed_scaling_factor and Qwen3-Next's norm_topk_prob are not in the file).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from conveyor.models.config import ATTENTION_LAYER_TYPES, ModelConfig
from conveyor.models.tensors import QuantizedTensor, Weight


def need(meta: Callable[..., Any], key: str) -> Any:
    """`meta(key)`, which the file must have (ValueError: it does not)."""
    value = meta(key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {meta('general.architecture')}.{key}")
    return value


def first_layer(layer_types: tuple[str, ...], kinds: tuple[str, ...]) -> int | None:
    return next((i for i, kind in enumerate(layer_types) if kind in kinds), None)


def first_sparse_layer(base: dict[str, Any]) -> int | None:
    return next((i for i in range(base["num_hidden_layers"]) if i not in base["dense_mlp_layers"]), None)


def attention_fields(layer_types: tuple[str, ...], tensors: dict) -> dict[str, Any]:
    """Per-head QK-norm on every hybrid's attention; q/k/v biases where its first attention layer has them."""
    attention = first_layer(layer_types, ATTENTION_LAYER_TYPES)
    return dict(qk_norm=True, attention_bias=attention is not None and (
        f"blk.{attention}.attn_q.bias" in tensors or f"blk.{attention}.attn_qkv.bias" in tensors))


class HybridTensors:
    """One hybrid GGUF's tensors -> HF names and values, tensor by tensor. A family's subclass names them: GLOBAL
    (llama.cpp's whole name -> HF module), BLOCK (under blk.N. -> under model.layers.N.) and PARAMETERS (a bare HF
    tensor: the full name under blk.N.). `release(tensor)` is called on a file view once a transform has made its
    own copy of it."""

    GLOBAL: dict[str, str] = {}
    BLOCK: dict[str, str] = {}
    PARAMETERS: dict[str, str] = {}

    def __init__(self, config: ModelConfig, release: Callable[[torch.Tensor], None]) -> None:
        self.config, self.release = config, release

    def weights(self, gguf_name: str, weight: Weight) -> dict[str, Weight]:
        """One GGUF tensor -> {HF name: weight}, several where llama.cpp fused them (ValueError: not one it knows)."""
        base, _, suffix = gguf_name.rpartition(".")
        if base in self.GLOBAL:
            return {f"{self.GLOBAL[base]}.{suffix}": weight}
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if match is None:
            raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
        layer, rest = int(match.group(1)), match.group(2)
        prefix = f"model.layers.{layer}."
        if rest in self.PARAMETERS:
            name = self.PARAMETERS[rest]
        else:
            base, _, suffix = rest.rpartition(".")
            if base == "attn_qkv" and self.config.layer_kind(layer) in ATTENTION_LAYER_TYPES:
                return self._split_qkv(prefix, suffix, weight)
            fused = self._split(prefix, base, suffix, weight)
            if fused is not None:
                return fused
            if suffix not in ("weight", "bias") or base not in self.BLOCK:
                raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
            name = f"{self.BLOCK[base]}.{suffix}"
        weight = self._undo(name, weight, gguf_name)
        if name.endswith(("conv.conv.weight", "conv1d.weight")) and isinstance(weight, torch.Tensor):
            weight = weight.unsqueeze(1)  # (C, K) -> HF's depthwise (C, 1, K), a view
        return {prefix + name: weight}

    def report(self, source: str) -> None:
        """Log what could not be kept as the file holds it (a family's transforms)."""

    def _split(self, prefix: str, base: str, suffix: str, weight: Weight) -> dict[str, Weight] | None:
        """A tensor of the family's that llama.cpp fused -> HF's (None: not one)."""
        return None

    def _undo(self, name: str, weight: Weight, gguf_name: str) -> Weight:
        """The family's converter transform of HF tensor `name`, undone."""
        return weight

    def _split_qkv(self, prefix: str, suffix: str, weight: Weight) -> dict[str, Weight]:
        """An attention layer's q|k|v fused by the converter (q includes Qwen3.5's per-head gate rows)."""
        cfg = self.config
        q_rows = cfg.num_attention_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        kv_rows = cfg.num_key_value_heads * cfg.head_dim
        parts, start = {}, 0
        for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            parts[f"{prefix}{self.BLOCK[part]}.{suffix}"] = rows_of(weight, start, start + rows)
            start += rows
        if start != weight.shape[0]:
            raise ValueError(f"fused attn_qkv of {prefix} has {weight.shape[0]} rows, expected {start}")
        return parts


def rows_of(weight: Weight, start: int, end: int) -> Weight:
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor(weight.qtype, (end - start, weight.shape[1]), weight.raw[start:end])
    return weight[start:end]
