"""Granite (3.x dense): Llama with four multipliers: embeddings, softmax scale, residual branches, logits."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                attention_scale=float(raw["attention_multiplier"]) if raw.get("attention_multiplier") else None,
                residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
                logits_scaling=float(raw.get("logits_scaling", 1.0)),
                attention_bias=bool(raw.get("attention_bias", False)))


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    return dict(embedding_multiplier=float(meta("embedding_scale", 1.0)), attention_scale=meta("attention.scale"),
                residual_multiplier=float(meta("residual_scale", 1.0)), logits_scaling=float(meta("logit_scale", 1.0)))


register(Family("granite", "conveyor.models.llama:LlamaForCausalLM", hf_fields, gguf_architectures=("granite",),
                gguf_fields=gguf_fields, gguf_permuted_qk=True))
