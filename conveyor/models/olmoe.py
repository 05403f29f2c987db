"""OLMoE: QK-norm over the whole q and k projections (one RMSNorm across all heads, as OLMo 2) and a
sparse MoE MLP in every layer, experts intermediate_size wide, top-k weights renormalised only with
norm_topk_prob. clip_qkv (unused by the released checkpoints) is refused."""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("clip_qkv") is not None:
        raise ValueError(f"olmoe with clip_qkv={raw['clip_qkv']} is not supported")
    return dict(qk_norm=True, qk_norm_scope="full", attention_bias=bool(raw.get("attention_bias", False)),
                num_experts=int(raw["num_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")

register(Family("olmoe", "conveyor.models.moe_llama:MoEForCausalLM", hf_fields, expert_names=EXPERT_NAMES,
                gguf_architectures=("olmoe",),
                # llama.cpp's build_moe_ffn does not renormalise OLMoE's top-k, whatever the metadata says
                gguf_fields=lambda meta, base, tensors: dict(norm_topk_prob=False)))
