"""DeepSeek-V3 (and checkpoints of its shape: Kimi K2, Moonlight): multi-head latent attention (models/mla.py) and
sparse MoE layers after the first `first_k_dense_replace` dense ones, routed by sigmoid scores with a choice-only
correction bias, group-limited (`n_group`, `topk_group`), renormalised and scaled by `routed_scaling_factor`,
beside `n_shared_experts` always-on experts (one ungated MLP of their summed width).
"""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register
from conveyor.models.mla_dims import MLADims, softmax_scale


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {raw['hidden_act']!r}")
    if raw.get("attention_bias"):  # off in every release (q_a / kv_a / o biases)
        raise NotImplementedError("attention_bias")
    if raw.get("quantization_config"):  # the released V3 / R1 weights are block-fp8 with weight_scale_inv
        raise NotImplementedError(f"quantization_config {raw['quantization_config'].get('quant_method')!r} "
                                  f"(convert to bf16, or use a GGUF)")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":  # V3's config says sigmoid; transformers assumes it
        raise NotImplementedError(f"scoring_func {raw['scoring_func']!r}")
    dims = MLADims(q_lora_rank=int(raw.get("q_lora_rank") or 0), kv_lora_rank=int(raw["kv_lora_rank"]),
                   qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                   v_head_dim=int(raw["v_head_dim"]), rope_interleave=bool(raw.get("rope_interleave", True)))
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    layers = int(raw["num_hidden_layers"])
    num_experts = int(raw.get("n_routed_experts") or 0)
    moe_width = int(raw.get("moe_intermediate_size") or 0)
    dense = layers if not num_experts else int(raw.get("first_k_dense_replace") or 0)
    return dict(
        mla=dims,
        # The paged cache keeps one "KV head" per token ([latent ; rotary key]); head_dim is the rotary width,
        # as transformers sets it, so the shared rotary table turns exactly the rope dims.
        num_key_value_heads=1, head_dim=dims.qk_rope_head_dim,
        attention_scale=softmax_scale(dims.qk_head_dim, rope),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        num_experts=num_experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_intermediate_size=moe_width, norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_scoring="sigmoid", moe_expert_bias=bool(num_experts), moe_renorm_eps=1e-20,
        moe_num_groups=int(raw.get("n_group") or 1), moe_topk_groups=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        shared_expert_intermediate_size=moe_width * int(raw.get("n_shared_experts") or 0) if num_experts else 0,
        dense_mlp_layers=tuple(range(min(dense, layers))),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", bias="gate.e_score_correction_bias",
                           shared_block="shared_experts")

register(Family("deepseek_v3", "conveyor.models.mla:DeepseekV3ForCausalLM", hf_fields, expert_names=EXPERT_NAMES))
