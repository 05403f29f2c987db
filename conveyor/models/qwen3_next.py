"""Qwen3-Next: Qwen3.5's hybrid (gated DeltaNet, gated attention with partial rotary every few layers,
(1 + w) norms) with sparse MoE MLPs that add a shared expert, HF config -> fields.

Its DeltaNet packs the input projections by key head: in_proj_qkvz holds, for each key head, q | k |
v | z of that head and of its group of value heads; in_proj_ba holds b | a the same way. models/hybrid.py
reorders their rows at load into Qwen3.5's q | k | v | z | b | a, so the forward runs one GEMM either way.
GGUF files hold q|k|v and z split already, under Qwen3.5's names; GGUFTensors (below) splits what they keep packed.
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.models import qwen3_5
from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register
from conveyor.models.tensors import QuantizedTensor, Weight

NAMES = {**qwen3_5.NAMES,
         "gated_deltanet": {**qwen3_5.NAMES["gated_deltanet"], "qkvz": "in_proj_qkvz", "ba": "in_proj_ba"}}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return {**qwen3_5.hf_fields(raw), **qwen3_5.shared_expert_moe_fields(raw),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
            # As in transformers: sparse where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
            "dense_mlp_layers": tuple(i for i in range(int(raw["num_hidden_layers"])) if i in dense or (i + 1) % step)}


EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


class GGUFTensors(qwen3_5.GGUFTensors):
    """Qwen3.5's names and transforms without the value-head reorder. HF's in_proj_qkvz (q|k|v|z per key head) was
    regrouped into attn_qkv (all q, all k, all v) and attn_gate (z), Qwen3.5's split names; in_proj_ba is ssm_ba,
    still b|a per key head, and older files keep in_proj_qkvz whole as ssm_in: both split here."""

    reordered_value_heads = False

    def _split(self, prefix: str, base: str, suffix: str, weight: Weight) -> dict[str, Weight] | None:
        """ssm_ba / ssm_in, rows grouped by key head -> Qwen3.5's split tensors, value heads in the same (grouped)
        order."""
        if base not in ("ssm_ba", "ssm_in") or suffix != "weight":
            return None
        cfg = self.config
        per_group = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        if base == "ssm_ba":
            sizes, roles = [per_group, per_group], ["in_proj_b", "in_proj_a"]
        else:
            value_rows = per_group * cfg.linear_value_head_dim
            sizes = [cfg.linear_key_head_dim, cfg.linear_key_head_dim, value_rows, value_rows]
            roles = ["in_proj_qkv", "in_proj_qkv", "in_proj_qkv", "in_proj_z"]
        if weight.shape[0] != cfg.linear_num_key_heads * sum(sizes):
            raise ValueError(f"{prefix}{base} has {weight.shape[0]} rows, expected "
                             f"{cfg.linear_num_key_heads * sum(sizes)}")
        parts = _ungroup_rows(weight, cfg.linear_num_key_heads, sizes)
        self.release(weight.raw if isinstance(weight, QuantizedTensor) else weight)
        out: dict[str, list[Weight]] = {}
        for role, part in zip(roles, parts):
            out.setdefault(f"{prefix}linear_attn.{role}.weight", []).append(part)
        return {name: _cat_rows(pieces) for name, pieces in out.items()}


def _ungroup_rows(weight: Weight, groups: int, sizes: list[int]) -> list[Weight]:
    """Rows grouped by key head g, | x_0 y_0 .. | x_1 y_1 .. | ..., with x_g `sizes[0]` rows and so on ->
    [x_0 x_1 .., y_0 y_1 .., ...] (copies). A quantized row is a whole output feature: raw rows move the same way."""
    rows = weight.raw if isinstance(weight, QuantizedTensor) else weight
    parts = [p.reshape(groups * size, rows.shape[1]).contiguous()
             for p, size in zip(rows.reshape(groups, sum(sizes), rows.shape[1]).split(sizes, dim=1), sizes)]
    if isinstance(weight, QuantizedTensor):
        return [QuantizedTensor(weight.qtype, (p.shape[0], weight.shape[1]), p) for p in parts]
    return parts


def _cat_rows(parts: list[Weight]) -> Weight:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], QuantizedTensor):
        raw = torch.cat([p.raw for p in parts])
        return QuantizedTensor(parts[0].qtype, (raw.shape[0], parts[0].shape[1]), raw)
    return torch.cat(parts)


register(Family("qwen3_next", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True,
                expert_names=EXPERT_NAMES, gguf_architectures=("qwen3next",), gguf_fields=qwen3_5.gguf_fields,
                gguf_weights=GGUFTensors))
