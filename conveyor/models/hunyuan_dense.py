"""Hunyuan dense (v1): Llama with per-head QK-norm *after* rotary, attention_bias covering o_proj too, and
NTK-alpha rotary (labelled "dynamic" with a fixed `alpha`: the base stretched once to
theta * alpha ** (d / (d - 2)), so nothing depends on the sequence length)."""

from __future__ import annotations

from typing import Any

from conveyor.models.family import Family, register

# query_layernorm / key_layernorm are the shared decoder's q_norm / k_norm
WEIGHT_RENAMES = {".self_attn.query_layernorm.": ".self_attn.q_norm.", ".self_attn.key_layernorm.": ".self_attn.k_norm."}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    fields: dict[str, Any] = dict(qk_norm=True, qk_norm_after_rope=True, attention_bias=bias, attention_out_bias=bias)
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        if not rope.get("alpha"):
            raise NotImplementedError("dynamic NTK rotary without a fixed alpha (frequencies by sequence length)")
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        fields.update(rope_theta=theta * float(rope["alpha"]) ** (head_dim / (head_dim - 2)), rope_scaling=None)
    return fields


register(Family("hunyuan_v1_dense", "conveyor.models.llama:LlamaForCausalLM", hf_fields, WEIGHT_RENAMES,
                gguf_architectures=("hunyuan-dense",),
                # the file's rope base already holds the NTK-alpha stretch
                gguf_fields=lambda meta, base, tensors: dict(qk_norm_after_rope=True)))
