"""OLMo 2 and 3: norms after attention and after the MLP only (none before), and QK-norm over the whole
q and k projections (one RMSNorm across all heads, before they are split), as transformers' Olmo2.
OLMo 3 adds sliding-window layers (three of every four by default) whose rotary is never scaled: a
scaling (YaRN in the long-context releases) applies to the full-attention layers only."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(norm_layout="post", qk_norm=True, qk_norm_scope="full",
                attention_bias=bool(raw.get("attention_bias", False)))


def olmo3_hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one dict per layer type
        full, local = dict(params["full_attention"] or {}), dict(params.get("sliding_attention") or {})
    else:
        full = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 500000.0)}
        local = {"rope_theta": full["rope_theta"]}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise NotImplementedError(f"rope scaling on the sliding layers ({local.get('rope_type')})")
    theta = float(full.pop("rope_theta", 500000.0))
    scaled = full.get("rope_type", full.get("type", "default")) != "default"
    local_theta = float(local.get("rope_theta", theta))
    return dict(hf_fields(raw), rope_theta=theta, rope_scaling=full if scaled else None,
                sliding_window=raw.get("sliding_window") or None, layer_types=tuple(types),
                # the sliding layers' own table, unscaled, only where it differs from the global one
                local_rope_theta=local_theta if scaled or local_theta != theta else None)


register(Family("olmo2", "conveyor.models.llama:LlamaForCausalLM", hf_fields),
         Family("olmo3", "conveyor.models.llama:LlamaForCausalLM", olmo3_hf_fields))
