"""Phi-3 / Phi-4-mini: Llama with q|k|v and gate|up fused in the checkpoint (loaded as our fused linears
directly) and su/longrope scaling (layers.py). Partial rotary (Phi-4-mini's 0.75) is refused."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor {raw['partial_rotary_factor']} is not supported (rotary over "
                         "the whole head only)")
    # NOTE: Phi-3-mini's window (2047) is applied on every layer, as transformers does; llama.cpp ignores it.
    return dict(sliding_window=raw.get("sliding_window") or None,
                attention_bias=bool(raw.get("attention_bias", False)))


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    # Phi-3's q|k|v (attn_qkv) and gate|up (ffn_up) stay fused in the file; longrope: its factor tensors
    window = meta("attention.sliding_window")
    return dict(sliding_window=int(window) if window else None)


register(Family("phi3", "conveyor.models.llama:LlamaForCausalLM", hf_fields, gguf_architectures=("phi3",),
                gguf_fields=gguf_fields, gguf_tensors={"ffn_up": "mlp.gate_up_proj"}))
