"""Gemma 4 (text): what its config says, and the tensors its checkpoints hold (the model: gemma4_model.py).

What differs from Gemma 3: RMSNorms scale by w (not 1 + w); softmax scale 1 (q and k are RMS-normed per head);
values RMS-normed per head without a weight; global layers with their own head dim (`global_head_dim` or
`per_layer_config`), fewer K/V heads and, with `attention_k_eq_v`, v taken from k's projection; global rope
"proportional" (only the first quarter of the frequencies turn, the rest stay 0, over the whole head); the last
`num_kv_shared_layers` layers attend over the K/V of the last earlier layer of their kind (no k/v of their own,
a double-wide MLP with `use_double_wide_mlp`); per-layer embeddings (PLE) gated into each layer after its MLP;
and a per-layer scalar on the whole hidden state.
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.models import gemma
from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, gguf_layer_types, register
from conveyor.models.kv_sharing import kv_sources


# The checkpoint's router.* and experts.* sit under one block, moe.*, as the shared expert names expect.
WEIGHT_RENAMES = {".router.": ".moe.router.", ".experts.": ".moe.experts."}


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("use_bidirectional_attention") == "all":
        raise NotImplementedError("use_bidirectional_attention 'all'")
    if raw.get("attention_bias"):
        raise NotImplementedError("attention_bias")
    layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
    types = list(gemma.layer_types(raw, layers, 6))
    types[-1] = "full_attention"  # as transformers forces it
    head_dim = int(raw.get("head_dim") or 256)
    kv_heads = int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    shape = _layer_shapes(raw, types, head_dim, kv_heads, k_eq_v)
    sources = kv_sources(types, int(raw.get("num_kv_shared_layers") or 0))
    width = int(raw["intermediate_size"])
    wide = bool(raw.get("use_double_wide_mlp", False))
    widths = tuple(width * (2 if wide and sources[i] != i else 1) for i in range(layers))
    ple = int(raw.get("hidden_size_per_layer_input") or 0)
    return dict(
        hidden_act=gemma._activation(raw), norm_layout="sandwich", norm_weight_offset=0.0,
        embedding_multiplier=math.sqrt(hidden), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        attention_scale=1.0, qk_norm=True, v_norm=True, attention_k_eq_v=k_eq_v,
        sliding_window=int(raw.get("sliding_window") or 512), layer_types=tuple(types),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        head_dim=head_dim, num_key_value_heads=kv_heads,
        layer_head_dims=tuple(d for d, _ in shape) if len(set(shape)) > 1 else (),
        layer_kv_heads=tuple(k for _, k in shape) if len(set(shape)) > 1 else (),
        layer_intermediate_sizes=widths if len(set(widths)) > 1 else (),
        kv_source_layers=sources if sources != tuple(range(layers)) else (),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(raw.get("vocab_size_per_layer_input") or raw["vocab_size"]) if ple else 0,
        **_experts(raw), **_rope(raw),
    )


def _experts(raw: dict[str, Any]) -> dict[str, Any]:
    """26B-A4B: every layer runs its dense MLP beside softmax top-k experts (GeGLU), renormalised, then scaled per
    expert; the router reads the layer's input RMS-normed without weight, times a learnt scale and hidden^-0.5."""
    if not raw.get("enable_moe_block"):
        return {}
    return dict(num_experts=int(raw["num_experts"]), num_experts_per_tok=int(raw["top_k_experts"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]), norm_topk_prob=True)


def _layer_shapes(raw: dict[str, Any], types: list[str], head_dim: int, kv_heads: int,
                  k_eq_v: bool) -> list[tuple[int, int]]:
    """(head dim, K/V heads) per layer: a saved config lists the global layers' in `per_layer_config` (by layer
    index); a released one names `global_head_dim` and `num_global_key_value_heads` (the latter with k_eq_v)."""
    per_layer = raw.get("per_layer_config")
    if per_layer is None:
        override: dict[str, Any] = {"head_dim": int(raw.get("global_head_dim") or 512)}
        if k_eq_v and raw.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
        per_layer = {i: override for i, kind in enumerate(types) if kind == "full_attention"}
    by_index = {int(key): value for key, value in per_layer.items() if str(key).isdigit()}
    return [(int(by_index.get(i, {}).get("head_dim") or head_dim),
             int(by_index.get(i, {}).get("num_key_value_heads") or kv_heads)) for i in range(len(types))]


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Global layers: rope_theta with "proportional" (or another) scaling; sliding layers: their own base only."""
    params = raw.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}) if "full_attention" in params else {}
    if local.get("rope_type", "default") != "default":
        raise NotImplementedError(f"sliding-layer rope_type {local['rope_type']!r}")
    fields = gemma._gemma3_rope(raw)
    if "rope_parameters" not in raw:  # transformers' defaults
        fields.update(rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25})
    return fields


def weight_names(config) -> list[str]:
    """Every tensor a Gemma 4 text model loads, in Hugging Face naming, the token embeddings first."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    if config.hidden_size_per_layer_input:
        names += ["model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
                  "model.per_layer_projection_norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "self_attn.q_proj.weight", p + "self_attn.o_proj.weight", p + "self_attn.q_norm.weight"]
        if config.kv_source(i) == i:
            names += [p + "self_attn.k_proj.weight", p + "self_attn.k_norm.weight"]
            if not shares_k_as_v(config, i):
                names.append(p + "self_attn.v_proj.weight")
        names += [f"{p}mlp.{part}_proj.weight" for part in ("gate", "up", "down")]
        names += [f"{p}{norm}.weight" for norm in config.layer_norm_names]
        names.append(p + "layer_scalar")
        if config.num_experts:
            names += expert_weight_names(config, p)
        if config.hidden_size_per_layer_input:
            names += [p + "per_layer_input_gate.weight", p + "per_layer_projection.weight",
                      p + "post_per_layer_input_norm.weight"]
    return names


def expert_weight_names(config, prefix: str) -> list[str]:
    """A 26B-A4B layer's router (projection, input scale, per-expert scale), experts and their extra norms."""

    experts = EXPERT_NAMES
    names = [experts.router(prefix), f"{prefix}moe.router.scale", f"{prefix}moe.router.per_expert_scale"]
    names += [experts.expert(prefix, e, part) for e in range(config.num_experts) for part in ("gate", "up", "down")]
    names += [f"{prefix}{norm}.weight" for norm in MOE_NORMS]
    return names


# Around the experts: their input norm, and one norm after each of the dense MLP and the experts.
MOE_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")


def shares_k_as_v(config, layer: int) -> bool:
    """Whether `layer`'s values are its keys' projection (attention_k_eq_v, on the global layers)."""
    return config.attention_k_eq_v and not config.is_sliding(layer)


# renamed from router.* / experts.* at load (WEIGHT_RENAMES); gate|up stacked (E, 2I, H)
EXPERT_NAMES = ExpertNames("moe", "gate_proj", "up_proj", "down_proj", router_name="router.proj")

def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's Gemma4Model: key_length is the global layers' head dim (key_length_swa the sliding
    ones'), head_count_kv and feed_forward_length per layer where they differ, the sliding pattern per layer, the
    last shared_kv_layers layers reading earlier K/V, v = k where a global layer has no attn_v, and the
    proportional rope as rope_freqs (1 for the pairs that turn, 1e30 for the rest: read as rope_scaling by
    loading/gguf_config.py); norms hold w as HF does."""
    layers, hidden = base["num_hidden_layers"], base["hidden_size"]
    types = gguf_layer_types(meta("attention.sliding_window_pattern"), layers, 6)
    sliding, full = int(meta("attention.key_length_swa", base["head_dim"])), base["head_dim"]
    dims = tuple(sliding if kind == "sliding_attention" else full for kind in types)
    kv = meta("attention.head_count_kv")
    kv_heads = tuple(int(n) for n in kv) if isinstance(kv, list) else (int(kv),) * layers
    widths = meta("feed_forward_length")
    widths = tuple(int(n) for n in widths) if isinstance(widths, list) else ()
    sources = kv_sources(list(types), int(meta("attention.shared_kv_layers", 0) or 0))
    owners_full = [i for i in range(layers) if sources[i] == i and types[i] == "full_attention"]
    ple = int(meta("embedding_length_per_layer_input", 0) or 0)
    return dict(
        hidden_act="gelu_tanh", norm_layout="sandwich", embedding_multiplier=math.sqrt(hidden), attention_scale=1.0,
        qk_norm=True, qk_norm_scope="head", v_norm=True, sliding_window=int(meta("attention.sliding_window")),
        layer_types=types,
        final_logit_softcapping=meta("final_logit_softcapping") or None, head_dim=sliding,
        num_key_value_heads=kv_heads[0], local_rope_theta=float(meta("rope.freq_base_swa", 10000.0)),
        layer_head_dims=dims if len(set(dims)) > 1 else (), layer_kv_heads=kv_heads if len(set(kv_heads)) > 1 else (),
        layer_intermediate_sizes=widths if len(set(widths)) > 1 else (), intermediate_size=widths[0] if widths else
        base["intermediate_size"], kv_source_layers=sources if sources != tuple(range(layers)) else (),
        attention_k_eq_v=bool(owners_full) and all(f"blk.{i}.attn_v.weight" not in tensors for i in owners_full),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(tensors["per_layer_token_embd.weight"][1]) if ple else 0)


# llama.cpp's names for Gemma 4 and 3n: the per-layer embeddings (PLE), Gemma's sandwich (ffn_norm before the MLP),
# and each layer's PLE gate, projection and norm
GGUF_PLE_TENSORS = {"per_layer_token_embd": "model.embed_tokens_per_layer",
                    "per_layer_model_proj": "model.per_layer_model_projection",
                    "per_layer_proj_norm": "model.per_layer_projection_norm",
                    "ffn_norm": "pre_feedforward_layernorm", "inp_gate": "per_layer_input_gate",
                    "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm"}
# and Gemma 4's: the per-layer scalar (a bare tensor in HF), and 26B-A4B's experts' input norm, the norms after the
# dense MLP and after the experts, the router's input scale and the per-expert scale
GGUF_TENSORS = {**GGUF_PLE_TENSORS, "layer_output_scale.weight": "layer_scalar",
                "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
                "post_ffw_norm_2": "post_feedforward_layernorm_2", "ffn_gate_inp.scale": "moe.router.scale",
                "ffn_down_exps.scale": "moe.router.per_expert_scale"}

register(Family("gemma4_text", "conveyor.models.gemma4_model:Gemma4ForCausalLM", hf_fields, WEIGHT_RENAMES,
                weight_names, multimodal_type="gemma4", expert_names=EXPERT_NAMES, gguf_architectures=("gemma4",),
                gguf_fields=gguf_fields, gguf_tensors=GGUF_TENSORS))
