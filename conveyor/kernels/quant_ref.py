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

# What Q4_K_M / Q5_K_M / Q6_K / Q8_0 / Q4_0 ... files contain, and GPT-OSS's MXFP4 experts; the kernel runs
# each natively.
NATIVE_TYPES: frozenset[int] = frozenset(int(t) for t in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K,
                                                          Q.Q5_K, Q.Q6_K, Q.MXFP4))


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
