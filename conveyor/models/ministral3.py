"""Ministral 3 (text): Mistral with YaRN rotary (layers.py) and Llama 4's attention temperature: each query,
after rotary, is scaled by 1 + beta * log(1 + floor(pos / original_max_position_embeddings))."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register, register_multimodal_text


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 1_000_000.0)))
    beta = rope.pop("llama_4_scaling_beta", None)
    rope.pop("max_position_embeddings", None)  # transformers keeps a copy here; ours is the model's own
    kind = rope.get("rope_type", rope.get("type", "default"))
    original = rope.get("original_max_position_embeddings")
    if beta and not original:
        raise NotImplementedError("llama_4_scaling_beta without original_max_position_embeddings")
    return dict(rope_theta=theta, rope_scaling=rope if kind != "default" else None,
                attn_temperature_beta=float(beta or 0.0), attn_temperature_length=int(original or 0),
                sliding_window=raw.get("sliding_window") or None,
                attention_bias=False)


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    scaling = base["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn" and meta("rope.scaling.yarn_log_multiplier"):
        # llama.cpp's attention factor: mscale 1 over mscale_all_dim = the log multiplier
        scaling = dict(scaling, mscale=1.0, mscale_all_dim=float(meta("rope.scaling.yarn_log_multiplier")))
    beta = float(meta("attention.temperature_scale", 0.0) or 0.0)
    original = (scaling or {}).get("original_max_position_embeddings", 0)
    if beta and not original:
        raise ValueError("attention.temperature_scale without rope.scaling.original_context_length")
    return dict(rope_scaling=scaling, attn_temperature_beta=beta, attn_temperature_length=int(original))


register(Family("ministral3", "conveyor.models.llama:LlamaForCausalLM", hf_fields, gguf_architectures=("mistral3",),
                gguf_fields=gguf_fields, gguf_permuted_qk=True))
# Mistral 3's vision checkpoints (Ministral 3, Mistral Small 3.1 / 3.2) and Pixtral 12B's (llava; the tower:
# multimodal/pixtral.py) run their text_config here: a plain Mistral text config (no YaRN, no temperature) reads the
# same as Mistral's.
for _multimodal in ("mistral3", "llava"):
    register_multimodal_text(_multimodal, "ministral3")
