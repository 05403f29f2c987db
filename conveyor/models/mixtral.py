"""Mixtral: Llama attention (Mistral's sliding window if set) and a sparse MoE MLP in every layer:
softmax over all experts, top k, always renormalised; each expert is intermediate_size wide."""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(num_experts=int(raw["num_local_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
                sliding_window=raw.get("sliding_window"))


EXPERT_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")

register(Family("mixtral", "conveyor.models.moe_llama:MoEForCausalLM", hf_fields, expert_names=EXPERT_NAMES))
