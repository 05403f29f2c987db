"""Mamba2 (mamba2): attention-free, one RMSNorm and a Mamba2 mixer per layer (models/hybrid.py), HF
config -> fields.

NOTE: transformers keeps the residual stream in fp32 (residual_in_fp32) in a bf16 model; ours is in the
model dtype, as for every family (float32 runs agree exactly).
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.models.family import Family, register

NAMES = {
    "embed": "backbone.embeddings.weight", "layers": "backbone.layers.", "final_norm": "backbone.norm_f.weight",
    "layout": {"mamba": (("norm", ("mamba2",)),)},
    "mamba2": {"kind": "mamba2", "prefix": "mixer.", "in": "in_proj", "conv": "conv1d", "out": "out_proj",
               "norm": "norm"},
}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {raw['hidden_act']!r} (its convolution needs silu)")
    hidden, heads = int(raw["hidden_size"]), int(raw.get("num_heads", 128))
    dt_min, dt_max = (float(v) for v in raw.get("time_step_limit") or (0.0, math.inf))
    return dict(
        layer_types=("mamba",) * int(raw["num_hidden_layers"]), use_rope=False,
        # no attention and no MLP: positive placeholders that no layer reads
        num_attention_heads=1, num_key_value_heads=1, head_dim=hidden, intermediate_size=hidden,
        rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        conv_kernel_size=int(raw.get("conv_kernel", 4)), conv_bias=bool(raw.get("use_conv_bias", True)),
        mamba_num_heads=heads, mamba_head_dim=int(raw.get("head_dim", 64)),
        mamba_state_size=int(raw.get("state_size", 128)), mamba_num_groups=int(raw.get("n_groups", 8)),
        mamba_proj_bias=bool(raw.get("use_bias", False)), mamba_dt_min=dt_min, mamba_dt_max=dt_max,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


register(Family("mamba2", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True))
