"""Seed-OSS: Llama with q/k/v biases on by default, and separate switches for o_proj's and the MLP's."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(attention_bias=bool(raw.get("attention_bias", True)),
                attention_out_bias=bool(raw.get("attention_out_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)), head_dim=int(raw.get("head_dim") or 128),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)))


register(Family("seed_oss", "conveyor.models.llama:LlamaForCausalLM", hf_fields,
                gguf_architectures=("seed_oss",)))
