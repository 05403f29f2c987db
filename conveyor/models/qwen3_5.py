"""Qwen3.5 (text) and Qwen3.5-MoE (text): gated DeltaNet linear attention, with a full-attention layer
every few layers (models/hybrid.py), HF config -> fields.

Attention layers are Qwen3's with an output gate (q_proj yields q and a gate per head; the output is
times sigmoid(gate)) and rotary on the first quarter of each head. Every RMSNorm scales by (1 + w)
(the 1 added at load), but the DeltaNet's gated norm, which scales by w.
"""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register

# The channel step: the sparse MoE block in MoE layers (Qwen3.5-MoE, Qwen3-Next), the SwiGLU MLP elsewhere.
_CHANNEL = ("post_attention_layernorm", (("experts", "mlp"),))

NAMES = {
    "embed": "model.embed_tokens.weight", "layers": "model.layers.", "final_norm": "model.norm.weight",
    "layout": {"linear_attention": (("input_layernorm", ("gated_deltanet",)), _CHANNEL),
               "full_attention": (("input_layernorm", ("attention",)), _CHANNEL)},
    "attention": {"kind": "attention", "prefix": "self_attn.", "q": "q_proj", "k": "k_proj", "v": "v_proj",
                  "o": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"},
    "gated_deltanet": {"kind": "gated_deltanet", "prefix": "linear_attn.", "qkv": "in_proj_qkv", "z": "in_proj_z",
                       "b": "in_proj_b", "a": "in_proj_a", "conv": "conv1d", "out": "out_proj", "norm": "norm"},
    "mlp": {"kind": "mlp", "prefix": "mlp.", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "experts": {"kind": "moe", "prefix": ""},  # MOE_EXPERT_NAMES: mlp.gate, mlp.experts.N.gate_proj, mlp.shared_expert ...
}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if not types:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return dict(
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), qk_norm=True, attn_output_gate=True,
        norm_weight_offset=1.0, layer_types=tuple(types),
        conv_kernel_size=int(raw.get("linear_conv_kernel_dim", 4)),
        linear_num_key_heads=int(raw["linear_num_key_heads"]), linear_num_value_heads=int(raw["linear_num_value_heads"]),
        linear_key_head_dim=int(raw["linear_key_head_dim"]), linear_value_head_dim=int(raw["linear_value_head_dim"]),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def shared_expert_moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Sparse MoE blocks with a shared expert gated by sigmoid (Qwen3-Next, Qwen3.5-MoE): softmax router."""
    # transformers 5 may save num_experts as num_local_experts (an attribute_map alias).
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                shared_expert_gate=True)


def moe_hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE: every layer's MLP is sparse, its top-k weights always renormalised."""
    moe = shared_expert_moe_fields(raw)
    # No layer is dense and the config names no dense width; the field only has to be valid.
    return {**hf_fields(raw), **moe, "norm_topk_prob": True,
            "intermediate_size": int(raw.get("intermediate_size") or moe["moe_intermediate_size"])}


MOE_EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")

# GGUF files: their config fields and tensors are loading/gguf_hybrid.py's
register(Family("qwen3_5_text", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True,
                multimodal_type="qwen3_5", gguf_architectures=("qwen35",)),
         Family("qwen3_5_moe_text", "conveyor.models.hybrid:HybridForCausalLM", moe_hf_fields, hybrid=True,
                multimodal_type="qwen3_5_moe", expert_names=MOE_EXPERT_NAMES, gguf_architectures=("qwen35moe",)))
