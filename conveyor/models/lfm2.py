"""LFM2 and LFM2-MoE (Liquid): short-convolution layers beside attention (models/hybrid.py), HF config -> fields.

Each layer is pre-norm: `operator_norm` before the token mixer (LFM2's gated short convolution, or
attention with per-head QK-norm), `ffn_norm` before the SwiGLU MLP; the final norm is `embedding_norm`.
GGUF files (`lfm2`, `lfm2moe`) load through models/hybrid_gguf.py with the names and fields below.
"""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register
from conveyor.models.hybrid_gguf import HybridTensors, attention_fields, first_layer, first_sparse_layer, need

# The channel step: LFM2-MoE's experts in its MoE layers, the SwiGLU MLP in the others (and in all of LFM2's).
_CHANNEL = ("ffn_norm", (("experts", "mlp"),))

# Where the checkpoint keeps each part (see hybrid_layout.py): per layer kind, its sublayers as
# (norm, mixers); each mixer's kind and tensor names under `model.layers.N.`.
NAMES = {
    "embed": "model.embed_tokens.weight", "layers": "model.layers.", "final_norm": "model.embedding_norm.weight",
    "layout": {"conv": (("operator_norm", ("short_conv",)), _CHANNEL),
               "full_attention": (("operator_norm", ("attention",)), _CHANNEL)},
    "attention": {"kind": "attention", "prefix": "self_attn.", "q": "q_proj", "k": "k_proj", "v": "v_proj",
                  "o": "out_proj", "q_norm": "q_layernorm", "k_norm": "k_layernorm"},
    "short_conv": {"kind": "short_conv", "prefix": "conv.", "in": "in_proj", "out": "out_proj", "conv": "conv"},
    "mlp": {"kind": "mlp", "prefix": "feed_forward.", "gate": "w1", "up": "w3", "down": "w2"},
    "experts": {"kind": "moe", "prefix": ""},  # MOE_EXPERT_NAMES (below): feed_forward.experts.N.w1 ...
}


def mlp_width(raw: dict[str, Any]) -> int:
    """LFM2 shrinks the configured width to 2/3, scales it and rounds up to a multiple (as transformers does)."""
    width = int(raw.get("intermediate_size") or raw.get("block_ff_dim"))
    if raw.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            width = int(multiplier * width)
            multiple = int(raw.get("block_multiple_of", 256))
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if not types:
        full = raw.get("full_attn_idxs")
        full = set(range(layers) if full is None else full)
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    return dict(
        intermediate_size=mlp_width(raw), rms_norm_eps=float(raw.get("norm_eps", 1e-5)), qk_norm=True,
        layer_types=tuple(types), conv_kernel_size=int(raw.get("conv_L_cache", 3)),
        conv_bias=bool(raw.get("conv_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", raw.get("tie_embedding", True))),
    )


def moe_hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """LFM2-MoE: sparse MLPs after the first num_dense_layers. The router scores experts by sigmoid, picks
    the top k by score + expert_bias, renormalises the k scores (+1e-6) and scales them."""
    layers = int(raw["num_hidden_layers"])
    return {**hf_fields(raw),
            "intermediate_size": int(raw["intermediate_size"]),  # the dense layers' width as configured (no 2/3)
            "num_experts": int(raw["num_experts"]), "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
            "dense_mlp_layers": tuple(range(min(int(raw.get("num_dense_layers", 2)), layers))),
            "moe_scoring": "sigmoid", "moe_expert_bias": bool(raw.get("use_expert_bias", True)), "moe_renorm_eps": 1e-6,
            "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0))}


MOE_EXPERT_NAMES = ExpertNames("feed_forward", "w1", "w3", "w2")

# expert_gating_func values (gguf.ExpertGatingFuncType) -> ModelConfig.moe_scoring
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def gguf_fields(meta, base: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """convert_hf_to_gguf's LFM2Model / LFM2MoeModel: a layer is a short convolution where its
    attention.head_count_kv is 0; LFM2-MoE's sparse MLPs follow leading_dense_block_count dense ones."""
    kv_heads = need(meta, "attention.head_count_kv")  # per layer: 0 on a short-convolution layer
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * base["num_hidden_layers"]
    if meta("attention.sliding_window"):
        raise ValueError("LFM2 with sliding-window attention (LFM2.5's audio detokenizer) is not supported")
    types = tuple("conv" if n == 0 else "full_attention" for n in kv_heads)
    conv = first_layer(types, ("conv",))
    fields = dict(layer_types=types, conv_kernel_size=int(need(meta, "shortconv.l_cache")),
                  conv_bias=conv is not None and f"blk.{conv}.shortconv.conv.bias" in tensors,
                  **attention_fields(types, tensors))
    if not base.get("num_experts"):
        return fields
    gating = int(need(meta, "expert_gating_func"))  # llama.cpp's lfm2moe reads it (the Qwen graphs: softmax)
    if gating not in _GGUF_GATING:
        raise ValueError(f"unsupported expert_gating_func {gating} (supported: softmax, sigmoid)")
    sparse = first_sparse_layer(base)
    # the renormalisation's epsilon is transformers' (the file does not say; 1e-6 is below bf16's resolution)
    return dict(fields, moe_scoring=_GGUF_GATING[gating], moe_renorm_eps=1e-6,
                moe_expert_bias=sparse is not None and f"blk.{sparse}.exp_probs_b.bias" in tensors)


class GGUFTensors(HybridTensors):
    """llama.cpp's names; its final norm is token_embd_norm, its conv squeezed (the base class restores it), and
    LFM2-MoE's expert_bias is exp_probs_b (no head tensor: always tied)."""

    GLOBAL = {"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm", "output": "lm_head"}
    BLOCK = {
        "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
        "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
        "attn_k_norm": "self_attn.k_layernorm",
        "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
    }
    PARAMETERS = {"exp_probs_b.bias": "feed_forward.expert_bias"}


register(Family("lfm2", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True,
                multimodal_type="lfm2_vl", gguf_architectures=("lfm2",), gguf_fields=gguf_fields,
                gguf_weights=GGUFTensors),
         Family("lfm2_moe", "conveyor.models.hybrid:HybridForCausalLM", moe_hf_fields, hybrid=True,
                expert_names=MOE_EXPERT_NAMES, gguf_architectures=("lfm2moe",), gguf_fields=gguf_fields,
                gguf_weights=GGUFTensors))
