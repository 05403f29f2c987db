"""GLM-4 (0414): Gemma's sandwich of norms under other names, gate|up fused in the checkpoint (as Phi-3),
q/k/v biases, and interleaved rotary on half of each head (partial_rotary_factor 0.5; q/k rows permuted at load)."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register

# GLM's norm after attention is post_self_attn_layernorm; its post_attention_layernorm is the norm before the MLP.
WEIGHT_RENAMES = {".post_self_attn_layernorm.": ".post_attention_layernorm.",
                  ".post_attention_layernorm.": ".pre_feedforward_layernorm.",
                  ".post_mlp_layernorm.": ".post_feedforward_layernorm."}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(norm_layout="sandwich", rope_interleaved=True, attention_bias=bool(raw.get("attention_bias", True)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1.5625e-07)))


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    rotary = int(meta("rope.dimension_count", base["head_dim"] // 2))
    return dict(norm_layout="sandwich", rope_interleaved=True, partial_rotary_factor=rotary / base["head_dim"])


# llama.cpp's names: Gemma's sandwich (ffn_norm before the MLP) with gate|up fused in ffn_up
register(Family("glm4", "conveyor.models.llama:LlamaForCausalLM", hf_fields, WEIGHT_RENAMES,
                gguf_architectures=("glm4",), gguf_fields=gguf_fields,
                gguf_tensors={"ffn_norm": "pre_feedforward_layernorm", "ffn_up": "mlp.gate_up_proj"}))
