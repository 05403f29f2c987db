"""Multi-head latent attention (DeepSeek-V3, models/deepseek_v3.py) over a paged cache of compressed latents.

Each token keeps one row per layer: [c ; k_rope], its latent c = kv_a_layernorm(kv_a(x)[:L]) (L = kv_lora_rank)
and the rotary key k_rope (R = qk_rope_head_dim) that every head shares, instead of heads x (K + V). Attention
runs on the absorbed form, prefill and decode alike, so a row's arithmetic never depends on how it was scheduled:

    score_h(t) = q_nope_h . (Wk_h c_t) + q_rope_h . k_rope_t = [Wk_h^T q_nope_h ; q_rope_h] . [c_t ; k_rope_t]
    out_h      = sum_t p_h(t) (Wv_h c_t) = Wv_h (sum_t p_h(t) c_t)

so the kernel sees H query heads over one shared KV head whose key row is [c ; k_rope] and whose value row is
the same row (its first L columns are c; the R rotary columns come out too and are dropped). Wk_h (N x L) and
Wv_h (V x L) are kv_b_proj's per-head halves; each head's product is its own row-invariant GEMM.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.kernels.attention import write_rows
from conveyor.models.cache_specs import CacheSpec, KVSpec
from conveyor.models.config import ModelConfig
from conveyor.models.layers import RMSNorm, RotaryEmbedding, RowInvariantLinear
from conveyor.models.mla_dims import MLADims
from conveyor.models.moe_llama import MoEForCausalLM
from conveyor.models.tensors import QuantizedTensor, Weight
from conveyor.models.weights import WeightLoader

KVCache = tuple[torch.Tensor, torch.Tensor]  # (K, K): one (num_blocks, block_size, 1, L + R) tensor
Rope = tuple[torch.Tensor, torch.Tensor]  # (T, 1, R) cos and signed sin

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class HeadwiseLinear(nn.Module):
    """A different (out, in) weight per head: (T, H, in) -> (T, H, out), one row-invariant GEMM per head."""

    def __init__(self, num_heads: int, in_features: int, out_features: int, ops: KernelBackend) -> None:
        super().__init__()
        self.heads = nn.ModuleList(RowInvariantLinear(in_features, out_features, False, ops) for _ in range(num_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([linear(x[:, h].contiguous()) for h, linear in enumerate(self.heads)], dim=1)


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        dims = config.mla
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.dims = dims
        self.q_size = self.num_heads * dims.qk_head_dim
        self.q_in = dims.q_lora_rank or self.q_size
        # q_a_proj (or q_proj) and kv_a_proj_with_mqa both read the hidden state: fused into one GEMM at load.
        self.in_proj = RowInvariantLinear(config.hidden_size, self.q_in + dims.cache_width, False, ops)
        self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS, ops) if dims.q_lora_rank else None
        self.q_b_proj = RowInvariantLinear(dims.q_lora_rank, self.q_size, False, ops) if dims.q_lora_rank else None
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.k_absorb = HeadwiseLinear(self.num_heads, dims.qk_nope_head_dim, dims.kv_lora_rank, ops)  # Wk_h^T
        self.v_up = HeadwiseLinear(self.num_heads, dims.kv_lora_rank, dims.v_head_dim, ops)  # Wv_h
        self.o_proj = RowInvariantLinear(self.num_heads * dims.v_head_dim, config.hidden_size, False, ops)
        self.scale = config.attention_scale

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        dims, num_tokens, heads = self.dims, x.shape[0], self.num_heads
        q, kv = self.in_proj(x).split([self.q_in, dims.cache_width], dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q_nope, q_rope = q.reshape(num_tokens, heads, dims.qk_head_dim).split(
            [dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)  # (T, H, N), (T, H, R)
        latent, k_rope = kv.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)  # (T, L), (T, R)
        latent = self.kv_a_layernorm(latent.contiguous())
        # rotary on q|k side by side (one pass), k as one more "head"
        rotated = RotaryEmbedding.apply(torch.cat([q_rope, k_rope[:, None]], dim=1), *rope)  # (T, H + 1, R)
        q_rope, k_rope = rotated.split([heads, 1], dim=1)
        write_rows(kv_cache[0], torch.cat([latent[:, None], k_rope], dim=-1), meta.slot_mapping)  # (T, 1, L + R)
        query = torch.cat([self.k_absorb(q_nope), q_rope], dim=-1)  # (T, H, L + R)
        # values = the key rows: the output's first L columns are sum_t p(t) c_t, the rest is dropped
        out = self.ops.paged_attention(query, kv_cache[0], kv_cache[1], meta, self.scale)  # (T, H, L + R)
        latent_out = out[..., :dims.kv_lora_rank]  # (T, H, L)
        return self.o_proj(self.v_up(latent_out).reshape(num_tokens, heads * dims.v_head_dim))


class DeepseekV3ForCausalLM(MoEForCausalLM):
    """The shared decoder with MLA in every layer; dense MLPs in the first layers, sparse ones after."""

    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__(config, ops)
        for layer in self.layers:  # the Llama attention built above is meta placeholders: nothing to free
            layer.self_attn = MLAAttention(config, ops)

    def cache_specs(self) -> list[CacheSpec]:
        """One [latent ; rotary key] row per token per layer; the values are read from it."""
        width = self.config.mla.cache_width
        return [KVSpec(1, width, 0, values_in_keys=True) for _ in range(self.config.num_hidden_layers)]

    def _load_attention(self, attn: nn.Module, get: Callable[[str], Weight], norm: Callable[[str], nn.Parameter],
                        p: str, loader: WeightLoader, fused) -> None:
        dims, heads = self.config.mla, self.config.num_attention_heads
        a = p + "self_attn."
        q_name = "q_a_proj" if dims.q_lora_rank else "q_proj"
        q, kv_a = get(a + q_name + ".weight"), get(a + "kv_a_proj_with_mqa.weight")
        if dims.rope_interleave:  # the rope rows of q and k into rotate-half order (every score is unchanged)
            kv_a = _rows(kv_a, _halves(1, dims.cache_width, dims.kv_lora_rank, dims.qk_rope_head_dim))
            q_rows = _halves(heads, dims.qk_head_dim, dims.qk_nope_head_dim, dims.qk_rope_head_dim)
            if not dims.q_lora_rank:
                q = _rows(q, q_rows)
        loader.linear(attn.in_proj, [q, kv_a])
        if dims.q_lora_rank:
            attn.q_a_layernorm.weight = norm(a + "q_a_layernorm.weight")
            q_b = get(a + "q_b_proj.weight")
            loader.linear(attn.q_b_proj, [_rows(q_b, q_rows) if dims.rope_interleave else q_b])
        attn.kv_a_layernorm.weight = norm(a + "kv_a_layernorm.weight")
        k_b, v_b = _per_head_kv_b(get, a, heads, dims)
        for linear, weight in zip(attn.k_absorb.heads, k_b):
            loader.linear(linear, [weight])
        for linear, weight in zip(attn.v_up.heads, v_b):
            loader.linear(linear, [weight])
        loader.linear(attn.o_proj, [get(a + "o_proj.weight")])


def _per_head_kv_b(get: Callable[[str], Weight], a: str, heads: int,
                   dims: MLADims) -> tuple[list[Weight], list[Weight]]:
    """Each head's Wk_h^T (L, N) and Wv_h (V, L): from llama.cpp's split k_b / v_b (already per head, k
    transposed; blocks stay blocks), or from kv_b_proj (H * (N + V), L), split and transposed here."""
    L, N, V = dims.kv_lora_rank, dims.qk_nope_head_dim, dims.v_head_dim
    if _has(get, a + "k_b_proj.weight"):
        k_b, v_b = get(a + "k_b_proj.weight"), get(a + "v_b_proj.weight")  # (H * L, N), (H * V, L)
        return [_row_slice(k_b, h * L, L) for h in range(heads)], [_row_slice(v_b, h * V, V) for h in range(heads)]
    kv_b = get(a + "kv_b_proj.weight")
    # NOTE: in the checkpoint's dtype (a legacy GGUF's blocks dequantized to fp32), so that --weight-dtype q8_0
    # quantizes each head from the same values as llama.cpp's split tensors hold.
    kv_b = (kv_b.dequantize() if isinstance(kv_b, QuantizedTensor) else kv_b).view(heads, N + V, L)
    return ([kv_b[h, :N].T.contiguous() for h in range(heads)], [kv_b[h, N:].contiguous() for h in range(heads)])


def _has(get: Callable[[str], Weight], name: str) -> bool:
    """Whether the checkpoint has `name` (tensor_getters' get raises KeyError when not)."""
    try:
        get(name)
    except KeyError:
        return False
    return True


def _halves(heads: int, head_width: int, offset: int, rotary: int) -> torch.Tensor:
    """Row order of `heads` heads of `head_width` rows whose rows [offset, offset + rotary) are rotary pairs
    (2i, 2i + 1): those go to rotate-half order [0, 2, 4, .., 1, 3, 5, ..]; every other row stays."""
    within = torch.cat([torch.arange(offset), offset + torch.arange(0, rotary, 2), offset + torch.arange(1, rotary, 2),
                        torch.arange(offset + rotary, head_width)])
    return (torch.arange(heads)[:, None] * head_width + within).reshape(-1)


def _rows(weight: Weight, order: torch.Tensor) -> Weight:
    """Output rows of a weight reordered (a quantized row is a whole output feature: blocks move as rows)."""
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor(weight.qtype, weight.shape, weight.raw[order])
    return weight[order]


def _row_slice(weight: Weight, start: int, rows: int) -> Weight:
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor(weight.qtype, (rows, weight.shape[1]), weight.raw[start:start + rows])
    return weight[start:start + rows]
