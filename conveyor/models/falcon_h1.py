"""Falcon-H1 (falcon_h1): attention and Mamba2 side by side in every layer (models/hybrid.py), HF config
-> fields.

Each layer: `input_layernorm`, then Mamba2 and attention on the same normed input, their outputs summed
into the residual; `pre_ff_layernorm` before a SwiGLU MLP. Falcon-H1's µP multipliers (on the Mamba2
input and its in_proj sections, the attention input, keys and output, the MLP gate and output) are
linear in the weights they follow or precede, so they are folded into those weights at load; the
embedding and lm_head multipliers scale at run time.
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.models.family import Family, register

NAMES = {
    "embed": "model.embed_tokens.weight", "layers": "model.layers.", "final_norm": "model.final_layernorm.weight",
    "layout": {"hybrid": (("input_layernorm", ("mamba2", "attention")), ("pre_ff_layernorm", ("mlp",)))},
    "mamba2": {"kind": "mamba2", "prefix": "mamba.", "in": "in_proj", "conv": "conv1d", "out": "out_proj",
               "norm": "norm"},
    "attention": {"kind": "attention", "prefix": "self_attn.", "q": "q_proj", "k": "k_proj", "v": "v_proj",
                  "o": "o_proj"},
    "mlp": {"kind": "mlp", "prefix": "feed_forward.", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {raw['hidden_act']!r} (its MLP and Mamba2 convolution need silu)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise NotImplementedError("attention_bias / mlp_bias (o_proj and MLP biases)")
    if bool(raw.get("projectors_bias", False)) != bool(raw.get("mamba_proj_bias", False)):
        raise NotImplementedError("projectors_bias differing from mamba_proj_bias (one bias setting for both "
                                  "Mamba2 projections)")
    hidden, heads = int(raw["hidden_size"]), int(raw.get("mamba_n_heads", 128))
    inner = int(raw.get("mamba_d_ssm") or int(raw.get("mamba_expand", 2)) * hidden)
    head_dim = raw.get("mamba_d_head", "auto")
    dt_min, dt_max = (float(v) for v in raw.get("time_step_limit") or (0.0, math.inf))
    gate, down = raw.get("mlp_multipliers") or (1.0, 1.0)
    return dict(
        layer_types=("hybrid",) * int(raw["num_hidden_layers"]),
        conv_kernel_size=int(raw.get("mamba_d_conv", 4)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
        mamba_num_heads=heads, mamba_head_dim=inner // heads if head_dim == "auto" else int(head_dim),
        mamba_state_size=int(raw.get("mamba_d_state", 256)), mamba_num_groups=int(raw.get("mamba_n_groups", 1)),
        mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)), mamba_dt_min=dt_min, mamba_dt_max=dt_max,
        mamba_rms_norm=bool(raw.get("mamba_rms_norm", False)),
        mamba_norm_before_gate=bool(raw.get("mamba_norm_before_gate", True)),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        logits_scaling=1.0 / float(raw.get("lm_head_multiplier", 1.0)),
        mamba_in_multiplier=float(raw.get("ssm_in_multiplier", 1.0)),
        mamba_section_multipliers=tuple(float(m) for m in raw.get("ssm_multipliers") or (1.0,) * 5),
        mamba_out_multiplier=float(raw.get("ssm_out_multiplier", 1.0)),
        attention_in_multiplier=float(raw.get("attention_in_multiplier", 1.0)),
        attention_key_multiplier=float(raw.get("key_multiplier", 1.0)),
        attention_out_multiplier=float(raw.get("attention_out_multiplier", 1.0)),
        mlp_gate_multiplier=float(gate), mlp_down_multiplier=float(down),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


register(Family("falcon_h1", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True))
