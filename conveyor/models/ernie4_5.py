"""ERNIE 4.5 (dense): Llama with interleaved rotary (pairs of adjacent dims; q/k rows permuted at load) and
one `use_bias` switch for every projection's bias (q/k/v/o and the MLP)."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("use_bias", False))
    return dict(rope_interleaved=True, attention_bias=bias, attention_out_bias=bias, mlp_bias=bias,
                head_dim=int(raw.get("head_dim") or 128),  # transformers' default, not hidden / heads
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


register(Family("ernie4_5", "conveyor.models.llama:LlamaForCausalLM", hf_fields, gguf_architectures=("ernie4_5",),
                # rotated as HF does in the file: no permute to undo
                gguf_fields=lambda meta, base, tensors: dict(rope_interleaved=True)))
