"""Qwen3-Next: Qwen3.5's hybrid (gated DeltaNet, gated attention with partial rotary every few layers,
(1 + w) norms) with sparse MoE MLPs that add a shared expert, HF config -> fields.

Its DeltaNet packs the input projections by key head: in_proj_qkvz holds, for each key head, q | k |
v | z of that head and of its group of value heads; in_proj_ba holds b | a the same way. models/hybrid.py
reorders their rows at load into Qwen3.5's q | k | v | z | b | a, so the forward runs one GEMM either way.
GGUF files hold them split already, under Qwen3.5's names (loading/gguf_hybrid.py), which load as they are.
"""

from __future__ import annotations

from typing import Any

from conveyor.models import qwen3_5
from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register

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

register(Family("qwen3_next", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True,
                expert_names=EXPERT_NAMES, gguf_architectures=("qwen3next",)))
