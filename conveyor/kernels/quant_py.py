"""TEMPORARY stand-in for the C++ qgemm module (same functions), until csrc/qgemm.cpp lands.

packed == raw GGML rows; linear dequantizes with gguf-py and multiplies in fp32. Slow; only so the
model/loader integration can be written and tested against the final API.
"""

from __future__ import annotations

import torch

from conveyor.kernels.quant_ref import NATIVE_TYPES, dequantize_raw, row_bytes


def isa() -> str:
    return "python"


def backend() -> str:
    return "python"


def supports(qtype: int) -> bool:
    return qtype in NATIVE_TYPES


def pack(raw: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    assert raw.dtype == torch.uint8 and raw.shape[1] == row_bytes(qtype, in_features)
    return raw.contiguous().clone()


def linear(x: torch.Tensor, packed: torch.Tensor, qtype: int, out_features: int, in_features: int,
           bias: torch.Tensor | None) -> torch.Tensor:
    weight = dequantize_raw(packed, qtype, in_features)
    out = x.float() @ weight.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def dequantize_rows(packed: torch.Tensor, qtype: int, out_features: int, in_features: int,
                    row_ids: torch.Tensor) -> torch.Tensor:
    return dequantize_raw(packed[row_ids], qtype, in_features).bfloat16()
