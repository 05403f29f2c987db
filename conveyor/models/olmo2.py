"""OLMo 2 and 3: norms after attention and after the MLP only (none before), and QK-norm over the whole
q and k projections (one RMSNorm across all heads, before they are split), as transformers' Olmo2.
OLMo 3 adds sliding-window layers (three of every four by default) whose rotary is never scaled: a
scaling (YaRN in the long-context releases) applies to the full-attention layers only."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, gguf_layer_types, register


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


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf writes OLMo 3 as olmo2, with its sliding-window keys."""
    full = tuple(tensors["blk.0.attn_q_norm.weight"]) != (base["head_dim"],)
    fields: dict[str, Any] = dict(norm_layout="post", qk_norm=True, qk_norm_scope="full" if full else "head")
    window = meta("attention.sliding_window")
    if window:  # OLMo 3: its sliding layers rotate unscaled (llama.cpp's freq_scale_swa = 1)
        fields.update(sliding_window=int(window), layer_types=gguf_layer_types(
            meta("attention.sliding_window_pattern"), base["num_hidden_layers"], 4))
        local = float(meta("rope.freq_base_swa", base["rope_theta"]))
        if base["rope_scaling"] or local != base["rope_theta"]:
            fields.update(local_rope_theta=local)
    return fields


register(Family("olmo2", "conveyor.models.llama:LlamaForCausalLM", hf_fields, gguf_architectures=("olmo2",),
                gguf_fields=gguf_fields),
         Family("olmo3", "conveyor.models.llama:LlamaForCausalLM", olmo3_hf_fields))
