"""GGML block-quantized weights: the types we run natively, and the reference math (tests, fallbacks).

A quantized weight travels as `raw`: a uint8 tensor (N, row_bytes) holding GGML blocks exactly as a
GGUF file stores them (row n = output feature n, K / block_size blocks per row). The C++ kernel
(csrc/qgemm.cpp) repacks `raw` once into its own layout of the same bits; the reference here
dequantizes with gguf-py and multiplies in fp32, which is what the kernel's accuracy is checked against.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

# What Q4_K_M / Q5_K_M / Q6_K / Q8_0 / Q4_0 ... files contain; the kernel runs each natively.
NATIVE_TYPES: frozenset[int] = frozenset(int(t) for t in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K,
                                                          Q.Q5_K, Q.Q6_K))


def type_name(qtype: int) -> str:
    return Q(qtype).name


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block)."""
    return gguf.GGML_QUANT_SIZES[Q(qtype)]


def row_bytes(qtype: int, in_features: int) -> int:
    block, size = block_shape(qtype)
    if in_features % block:
        raise ValueError(f"{type_name(qtype)} rows need a multiple of {block} weights, got {in_features}")
    return in_features // block * size


def dequantize_raw(raw: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """raw GGML rows (N, row_bytes) uint8 -> fp32 (N, in_features), by gguf-py (the reference)."""
    values = gguf.quants.dequantize(raw.contiguous().numpy(), Q(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(raw.shape[0], in_features)


def quantize_raw(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """fp32/bf16 (N, K) -> raw GGML rows (N, row_bytes) uint8, by gguf-py (Q8_0, Q4_0, ... as it supports)."""
    data = gguf.quants.quantize(weight.float().contiguous().numpy(), Q(qtype))
    return torch.from_numpy(np.ascontiguousarray(data)).view(torch.uint8).reshape(weight.shape[0], -1)


def reference_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x @ dequantize(raw)^T (+ bias): the accuracy reference for the quantized GEMM."""
    weight = dequantize_raw(raw, qtype, x.shape[1])
    out = x.float() @ weight.T
    return out if bias is None else out + bias.float()


def random_raw(qtype: int, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Raw GGML rows for tests and benchmarks, weights of a realistic spread (~N(0, 0.05)): quantized by
    gguf-py where it can, else random K-quant blocks with random bits and sane fp16 scales."""
    gen = torch.Generator().manual_seed(seed)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        return quantize_raw(torch.randn(out_features, in_features, generator=gen) * 0.05, qtype)
    block, size = gguf.GGML_QUANT_SIZES[Q(qtype)]
    n_blocks = out_features * in_features // block
    raw = torch.randint(0, 256, (n_blocks, size), generator=gen, dtype=torch.uint8)
    rng = np.random.default_rng(seed)
    d = torch.from_numpy((rng.uniform(0.2, 1.0, n_blocks) * 1e-3).astype(np.float16)).view(torch.uint8).view(-1, 2)
    dmin = torch.from_numpy((rng.uniform(0.2, 1.0, n_blocks) * 5e-3).astype(np.float16)).view(torch.uint8).view(-1, 2)
    if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d
        raw[:, 208:210] = d
        raw[:, 192:208] = torch.randint(-40, 40, (n_blocks, 16), generator=gen, dtype=torch.int8).view(torch.uint8)
    else:  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins
        raw[:, 0:2] = d
        raw[:, 2:4] = dmin
    return raw.reshape(out_features, -1)
