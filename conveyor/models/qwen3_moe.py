"""Qwen3-MoE: Qwen3's attention (per-head QK-norm) and sparse MoE MLPs of moe_intermediate_size; the top-k
weights renormalised only with norm_topk_prob; mlp_only_layers and decoder_sparse_step keep some layers dense."""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("use_sliding_window"):  # off in every released checkpoint
        raise ValueError("qwen3_moe with use_sliding_window is not supported")
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    # transformers 5 saves num_experts as num_local_experts (an attribute_map alias); the Hub's files say num_experts.
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    return dict(qk_norm=True, attention_bias=bool(raw.get("attention_bias", False)),
                num_experts=int(num_experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                # A layer is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
                dense_mlp_layers=tuple(i for i in range(int(raw["num_hidden_layers"])) if i in dense or (i + 1) % step))


EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")

register(Family("qwen3_moe", "conveyor.models.moe_llama:MoEForCausalLM", hf_fields, expert_names=EXPERT_NAMES,
                gguf_architectures=("qwen3moe",)))
