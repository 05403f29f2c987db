"""Multi-head latent attention's shape (DeepSeek-V3 and the checkpoints of its shape): its widths, its tensor
names and its softmax scale. Shared by the config, the loaders and the mixer (models/mla.py); no family's own."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention's widths (transformers' names). A token's K/V is its compressed latent
    (kv_lora_rank, after kv_a_layernorm) and one rotary key shared by every head (qk_rope_head_dim)."""

    q_lora_rank: int  # 0: q_proj reads the hidden state directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs (2i, 2i+1) in the checkpoint: q/k rows permuted at load

    def __post_init__(self) -> None:
        sizes = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(sizes) <= 0 or self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA widths must be positive with an even rotary width, got {self}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values per token per layer in the cache: [latent ; rotary key]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_weight_names(prefix: str, dims: MLADims, available: Collection[str]) -> list[str]:
    """One layer's MLA tensors under `prefix` (`model.layers.N.self_attn.`); kv_b_proj may come split per head
    into k_b_proj / v_b_proj (llama.cpp's GGUF layout, loading/gguf_config.py)."""
    q = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if dims.q_lora_rank else ["q_proj"]
    kv_b = ["k_b_proj", "v_b_proj"] if prefix + "k_b_proj.weight" in available else ["kv_b_proj"]
    return [f"{prefix}{name}.weight" for name in q + ["kv_a_proj_with_mqa", "kv_a_layernorm", *kv_b, "o_proj"]]


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim)^2 under a scaled rope (transformers'
    yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        mscale = _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * mscale * mscale
    return scale
