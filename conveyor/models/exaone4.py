"""EXAONE 4: norms after attention and after the MLP only (OLMo 2's "post" layout), per-head QK-norm, and
(with a sliding window) local layers with rotary beside global layers without it (NoPE)."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, gguf_layer_types, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    fields: dict[str, Any] = dict(norm_layout="post", qk_norm=True, attention_bias=False)
    window = raw.get("sliding_window")
    if not window:  # every layer global, with rotary
        return fields
    types = tuple(raw.get("layer_types") or _pattern_types(raw.get("sliding_window_pattern", 4), layers))
    return dict(fields, sliding_window=int(window), layer_types=types,
                no_rope_layers=tuple(i for i, kind in enumerate(types) if kind != "sliding_attention"))


def _pattern_types(pattern: Any, layers: int) -> list[str]:
    """`sliding_window_pattern` as a string ("LLLG": L local, G global, repeated) or every n-th layer global."""
    if isinstance(pattern, str):
        return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(layers)]
    return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    fields: dict[str, Any] = dict(norm_layout="post")
    window = meta("attention.sliding_window")
    if window:  # the global layers are NoPE
        types = gguf_layer_types(meta("attention.sliding_window_pattern"), base["num_hidden_layers"], 4)
        fields.update(sliding_window=int(window), layer_types=types,
                      no_rope_layers=tuple(i for i, kind in enumerate(types) if kind != "sliding_attention"))
    return fields


register(Family("exaone4", "conveyor.models.llama:LlamaForCausalLM", hf_fields, gguf_architectures=("exaone4",),
                gguf_fields=gguf_fields))
