"""The KV cache's element formats (--cache-type-k / --cache-type-v) and the torch twin of Q8_0 rows.

`bf16` keeps K or V in the activation dtype, as before. `q8_0` keeps each (token, KV head) row as
head_dim / 32 GGML Q8_0 blocks: an fp16 scale d, then 32 int8 values (34 bytes per 32 values, ~0.53x
bf16's bytes), in a uint8 cache tensor (num_blocks, block_size, kv_heads, row_bytes). The C++ kernels
read and write these bytes (csrc/kv_q8.h); the functions here are the same arithmetic in torch, for the
fallback paths (another device, no kernels) and as the tests' reference, and gguf-py reads the bytes
as Q8_0 (quant_ref.dequantize_raw).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BF16, Q8_0 = "bf16", "q8_0"
Q8_0_BLOCK = 32  # values per block, along head_dim
Q8_0_BLOCK_BYTES = 34  # fp16 d + 32 int8


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds Q8_0 rows (uint8) rather than values in the activation dtype."""
    return cache.dtype == torch.uint8


def check_head_dim(cache_type: str, head_dim: int) -> None:
    """ValueError when a layer's head_dim cannot be kept in `cache_type`."""
    if cache_type == Q8_0 and head_dim % Q8_0_BLOCK:
        raise ValueError(f"q8_0 KV cache needs head_dim to be a multiple of {Q8_0_BLOCK}, this model has "
                         f"head_dim {head_dim}: use --cache-type-k bf16 --cache-type-v bf16")


def cache_dtype(cache_type: str, dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if cache_type == Q8_0 else dtype


def row_width(cache_type: str, head_dim: int) -> int:
    """Elements of the cache tensor's dtype per (token, KV head) row."""
    return head_dim // Q8_0_BLOCK * Q8_0_BLOCK_BYTES if cache_type == Q8_0 else head_dim


def bytes_per_row(cache_type: str, head_dim: int, dtype: torch.dtype) -> int:
    element = torch.empty(0, dtype=cache_dtype(cache_type, dtype)).element_size()
    return row_width(cache_type, head_dim) * element


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """(..., D) values -> (..., D / 32 * 34) uint8 Q8_0 rows: d = amax / 127 (fp32, stored as fp16),
    q = round_half_even(x * (1 / d)); csrc/kv_q8.h's arithmetic, so both give the same bytes."""
    *lead, dim = x.shape
    blocks = x.float().reshape(*lead, dim // Q8_0_BLOCK, Q8_0_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
    scale = d.to(torch.float16).view(torch.uint8)  # (..., nb, 2)
    return torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(*lead, -1)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """(..., D / 32 * 34) uint8 -> (..., D) fp32, d * q."""
    *lead, width = raw.shape
    blocks = raw.contiguous().reshape(*lead, width // Q8_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # (..., nb, 1)
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(*lead, -1)


def as_values(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache, as values: Q8_0 dequantized (fp32), others unchanged."""
    return dequantize_q8_0(cache_rows) if is_quantized(cache_rows) else cache_rows.to(dtype)


@dataclass(frozen=True)
class KVCacheTypes:
    """--cache-type-k / --cache-type-v: how the pool keeps keys and values (each bf16 or q8_0)."""

    k: str = BF16
    v: str = BF16

    @property
    def quantized(self) -> bool:
        return Q8_0 in (self.k, self.v)

    def bytes_per_token_head(self, head_dim: int, dtype: torch.dtype) -> int:
        """K + V bytes of one token's row for one KV head."""
        return bytes_per_row(self.k, head_dim, dtype) + bytes_per_row(self.v, head_dim, dtype)

    def check_head_dim(self, head_dim: int) -> None:
        for cache_type in (self.k, self.v):
            check_head_dim(cache_type, head_dim)

    def describe(self) -> dict[str, str]:
        return {"k": self.k, "v": self.v}
