"""Llama 4 (Scout, Maverick; the text model): Llama with interleaved rotary, NoPE global layers (every 4th by
default) whose queries get an attention temperature by position, q/k L2-norm after rotary on the rotary layers,
and MoE layers (every `interleave_moe_layer_step`-th, or `moe_layers`) of sigmoid top-1 routing whose score
scales the expert's input, beside an always-on shared expert; dense MLP layers are `intermediate_size_mlp` wide.

The rotary layers attend in chunks of `attention_chunk_size` (each query within its own chunk: the attention
kernels' chunked mode), the NoPE layers globally; the K/V of every position is kept.
"""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register

# The checkpoint's feed_forward.* is the shared decoder's mlp.* (dense MLP, router, experts, shared expert).
WEIGHT_RENAMES = {".feed_forward.": ".mlp."}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {raw['hidden_act']!r}")
    layers = int(raw["num_hidden_layers"])
    interval = int(raw.get("no_rope_layer_interval") or 4)
    uses_rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    step = int(raw.get("interleave_moe_layer_step") or 1)
    moe_layers = raw.get("moe_layers")
    moe_layers = set(moe_layers if moe_layers is not None else range(step - 1, layers, step))
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    width = int(raw.get("intermediate_size", 8192))
    bias = bool(raw.get("attention_bias", False))
    tuning = bool(raw.get("attn_temperature_tuning", True))
    chunk = raw.get("attention_chunk_size")
    return dict(
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 500000.0))),
        rope_interleaved=True,  # transformers rotates complex pairs (2i, 2i+1)
        no_rope_layers=tuple(i for i in range(layers) if not uses_rope[i]),
        qk_l2_norm=bool(raw.get("use_qk_norm", True)),
        attn_temperature_beta=float(raw.get("attn_scale", 0.1)) if tuning else 0.0,
        attn_temperature_length=int(raw.get("floor_scale", 8192)),
        attn_temperature_nope_only=True, attn_temperature_offset=1,
        attention_chunk=int(chunk) if chunk and any(uses_rope[:layers]) else 0,
        attention_bias=bias, attention_out_bias=bias,
        intermediate_size=int(raw.get("intermediate_size_mlp", 16384)),
        num_experts=int(raw.get("num_local_experts", 16)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)),
        moe_intermediate_size=width, shared_expert_intermediate_size=width,
        moe_scoring="sigmoid", norm_topk_prob=False, moe_weight_input=True,
        dense_mlp_layers=tuple(i for i in range(layers) if i not in moe_layers),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


# renamed from feed_forward.* at load (WEIGHT_RENAMES)
EXPERT_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", router_name="router", stacked_transposed=True)

def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """What llama.cpp fixes for `llama4` (src/models/llama4.cpp): unless the file says sliding_window 0 (every
    layer rotary, unchunked), every 4th layer is NoPE with temperature 0.1 by floor 8192 and offset 1, and the
    rotary layers attend in 8192-token chunks; q/k L2-norm except with 128 experts (Maverick); q/k not permuted;
    the top-k weights never renormalised."""
    layers, width = base["num_hidden_layers"], base["moe_intermediate_size"]
    fields: dict[str, Any] = dict(rope_interleaved=True, qk_l2_norm=base["num_experts"] != 128,
                                  shared_expert_intermediate_size=width, moe_scoring="sigmoid", moe_weight_input=True,
                                  norm_topk_prob=False)
    window = meta("attention.sliding_window")
    if window is not None and int(window) == 0:
        return fields
    step = int(meta("attention.sliding_window_pattern", 4))
    return dict(fields, no_rope_layers=tuple(i for i in range(layers) if (i + 1) % step == 0),
                attn_temperature_beta=0.1, attn_temperature_length=8192, attn_temperature_offset=1,
                attn_temperature_nope_only=True, attention_chunk=8192)


# llama.cpp's names: the ungated shared expert beside the routed ones
GGUF_TENSORS = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj"}

register(Family("llama4_text", "conveyor.models.moe_llama:MoEForCausalLM", hf_fields, WEIGHT_RENAMES,
                multimodal_type="llama4", expert_names=EXPERT_NAMES, gguf_architectures=("llama4",),
                gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS))
