"""Nemotron-H (nemotron_h): one mixer per layer after one RMSNorm (models/hybrid.py), HF config -> fields.

`hybrid_override_pattern` (or `layers_block_type`) names each layer: M = Mamba2, * = attention (no
rotary), - = MLP (down(relu(up(x))^2), no gate), E = mixture of experts (relu^2 experts routed by
sigmoid scores plus a correction bias, group-limited top-k, and one always-on shared expert).
Multi-token-prediction layers (num_nextn_predict_layers) are not part of the forward and are not loaded.

NOTE: transformers' Nemotron-H RMSNorm multiplies by its weight in fp32 and rounds once; ours rounds the
normed value first, as Llama's does: only a bf16 run can tell them apart.
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register

NAMES = {
    "embed": "backbone.embeddings.weight", "layers": "backbone.layers.", "final_norm": "backbone.norm_f.weight",
    "layout": {"mamba": (("norm", ("mamba2",)),), "full_attention": (("norm", ("attention",)),),
               "mlp": (("norm", ("mlp",)),), "moe": (("norm", ("experts",)),)},
    "mamba2": {"kind": "mamba2", "prefix": "mixer.", "in": "in_proj", "conv": "conv1d", "out": "out_proj",
               "norm": "norm"},
    "attention": {"kind": "attention", "prefix": "mixer.", "q": "q_proj", "k": "k_proj", "v": "v_proj",
                  "o": "o_proj"},
    "mlp": {"kind": "mlp", "prefix": "mixer.", "up": "up_proj", "down": "down_proj"},
    # EXPERT_NAMES (below): mixer.gate (its e_score_correction_bias beside), mixer.experts.N.up_proj,
    # mixer.shared_experts.up_proj ...
    "experts": {"kind": "moe", "prefix": ""},
}

_PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}
# transformers' names (and its legacy ones) for the same kinds
_LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
                "full_attention": "full_attention", "mlp": "mlp", "moe": "moe"}


def _layer_kinds(raw: dict[str, Any]) -> list[str]:
    kinds = raw.get("layers_block_type") or raw.get("layer_types")
    if not kinds:
        pattern = raw.get("hybrid_override_pattern")
        if not pattern or set(pattern) - set(_PATTERN):
            raise NotImplementedError(f"hybrid_override_pattern {pattern!r} (expected a string of M, *, - and E)")
        return [_PATTERN[c] for c in pattern]
    if set(kinds) - set(_LAYER_KINDS):
        raise NotImplementedError(f"layer types {sorted(set(kinds) - set(_LAYER_KINDS))}")
    return [_LAYER_KINDS[k] for k in kinds]


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("mlp_hidden_act", "relu2") != "relu2":
        raise NotImplementedError(f"mlp_hidden_act {raw['mlp_hidden_act']!r} (supported: relu2)")
    if raw.get("mamba_hidden_act", "silu") != "silu":
        raise NotImplementedError(f"mamba_hidden_act {raw['mamba_hidden_act']!r} (supported: silu)")
    if raw.get("mlp_bias"):
        raise NotImplementedError("mlp_bias")
    if raw.get("moe_latent_size") is not None:
        raise NotImplementedError("moe_latent_size (latent projections around the experts)")
    kinds = _layer_kinds(raw)
    moe = "moe" in kinds
    heads = int(raw.get("num_attention_heads", 32))
    return dict(
        num_hidden_layers=len(kinds), layer_types=tuple(kinds), use_rope=False,
        num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or 128),  # transformers' default when the file has none
        intermediate_size=int(raw.get("intermediate_size", 21504)), hidden_act="relu2",
        rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        attention_bias=False,  # transformers' Nemotron-H attention has no biases, whatever the config says
        conv_kernel_size=int(raw.get("conv_kernel", raw.get("mamba_d_conv", 4))),
        conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        mamba_num_heads=int(raw.get("mamba_num_heads", 128)), mamba_head_dim=int(raw.get("mamba_head_dim", 64)),
        mamba_state_size=int(raw.get("ssm_state_size", 128)),
        mamba_num_groups=int(raw.get("n_groups", raw.get("mamba_n_groups", 8))),
        mamba_proj_bias=bool(raw.get("use_bias", False)),
        # transformers' mixer clamps dt to (time_step_min, inf), whatever time_step_limit says
        mamba_dt_min=float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))), mamba_dt_max=math.inf,
        num_experts=int(raw.get("n_routed_experts", 8)) if moe else 0,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)) if moe else 0,
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 7688)) if moe else 0,
        shared_expert_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size", 7688)) if moe else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)), moe_scoring="sigmoid", moe_expert_bias=moe,
        moe_renorm_eps=1e-20, moe_num_groups=int(raw.get("n_group", 1)), moe_topk_groups=int(raw.get("topk_group", 1)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


EXPERT_NAMES = ExpertNames("mixer", "", "up_proj", "down_proj", bias="gate.e_score_correction_bias",
                           shared_block="shared_experts")

register(Family("nemotron_h", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True,
                expert_names=EXPERT_NAMES))
