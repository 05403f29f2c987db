"""LFM2 and LFM2-MoE (Liquid): short-convolution layers beside attention (models/hybrid.py), HF config -> fields.

Each layer is pre-norm: `operator_norm` before the token mixer (LFM2's gated short convolution, or
attention with per-head QK-norm), `ffn_norm` before the SwiGLU MLP; the final norm is `embedding_norm`.
"""

from __future__ import annotations

from typing import Any

from conveyor.models.config import ExpertNames
from conveyor.models.family import Family, register

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

# GGUF files: their config fields and tensors are loading/gguf_hybrid.py's
register(Family("lfm2", "conveyor.models.hybrid:HybridForCausalLM", hf_fields, hybrid=True,
                gguf_architectures=("lfm2",)),
         Family("lfm2_moe", "conveyor.models.hybrid:HybridForCausalLM", moe_hf_fields, hybrid=True,
                expert_names=MOE_EXPERT_NAMES, gguf_architectures=("lfm2moe",)))
