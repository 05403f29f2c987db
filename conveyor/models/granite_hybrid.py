"""Granite 4.0-H (granitemoehybrid): Mamba2 layers with an attention layer every few (models/hybrid.py),
HF config -> fields.

Each layer: `input_layernorm` before its token mixer (Mamba2, or attention, rotary only when
position_embedding_type is "rope"), `post_attention_layernorm` before the shared SwiGLU MLP, beside which
a softmax-routed mixture of experts runs when num_local_experts > 0 (their outputs summed). Granite's
multipliers scale the embeddings, the softmax (attention_multiplier), every residual branch and the logits.
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register

_CHANNEL = ("post_attention_layernorm", ("experts", "mlp"))  # the experts are skipped in a dense model

# Where the checkpoint keeps each part (see hybrid_layout.py): per layer kind, its sublayers as
# (norm, mixers run side by side on its output); each mixer's tensor names under `model.layers.N.`.
NAMES = {
    "embed": "model.embed_tokens.weight", "layers": "model.layers.", "final_norm": "model.norm.weight",
    "layout": {"mamba": (("input_layernorm", ("mamba2",)), _CHANNEL),
               "full_attention": (("input_layernorm", ("attention",)), _CHANNEL)},
    "mamba2": {"kind": "mamba2", "prefix": "mamba.", "in": "in_proj", "conv": "conv1d", "out": "out_proj",
               "norm": "norm"},
    "attention": {"kind": "attention", "prefix": "self_attn.", "q": "q_proj", "k": "k_proj", "v": "v_proj",
                  "o": "o_proj"},
    "mlp": {"kind": "mlp", "prefix": "shared_mlp.", "gate_up": "input_linear", "down": "output_linear"},
    # EXPERT_NAMES (below): block_sparse_moe.router.layer, and every expert's gate|up and down
    # stacked in one 3-D tensor each (input_linear, output_linear), as the Hub has them
    "experts": {"kind": "moe", "prefix": ""},
}

# transformers' legacy layer names (its configuration_utils remaps them so too)
_LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
                "full_attention": "full_attention"}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {raw['hidden_act']!r} (its MLP and Mamba2 convolution need silu)")
    if raw.get("attention_bias"):
        raise NotImplementedError("attention_bias (its o_proj has a bias, which our attention lacks)")
    rope = raw.get("position_embedding_type")
    if rope not in (None, "nope", "rope"):
        raise NotImplementedError(f"position_embedding_type {rope!r}")
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * layers
    if set(kinds) - set(_LAYER_KINDS):
        raise NotImplementedError(f"layer types {sorted(set(kinds) - set(_LAYER_KINDS))}")
    hidden, heads = int(raw["hidden_size"]), int(raw.get("mamba_n_heads", 128))
    head_dim = raw.get("mamba_d_head", "auto")
    experts = int(raw.get("num_local_experts") or 0)
    dt_min, dt_max = (float(v) for v in raw.get("time_step_limit") or (0.0, math.inf))
    return dict(
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), layer_types=tuple(_LAYER_KINDS[k] for k in kinds),
        use_rope=rope == "rope", intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        attention_scale=float(raw.get("attention_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=int(raw["intermediate_size"]) if experts else 0,
        conv_kernel_size=int(raw.get("mamba_d_conv", 4)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
        mamba_num_heads=heads,
        mamba_head_dim=int(raw.get("mamba_expand", 2)) * hidden // heads if head_dim == "auto" else int(head_dim),
        mamba_state_size=int(raw.get("mamba_d_state", 256)), mamba_num_groups=int(raw.get("mamba_n_groups", 1)),
        mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)), mamba_dt_min=dt_min, mamba_dt_max=dt_max,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


# Granite's experts come stacked only; the per-expert names are unstack_experts' own
EXPERT_NAMES = ExpertNames("block_sparse_moe", "gate_proj", "up_proj", "down_proj", router_name="router.layer",
                           stacked_parts=("input_linear.weight", "output_linear.weight"))

register(Family("granitemoehybrid", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True,
                expert_names=EXPERT_NAMES))
