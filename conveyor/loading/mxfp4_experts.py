"""GPT-OSS's Hub checkpoints keep the experts in MXFP4 (`experts.{gate_up,down}_proj_blocks` and `_scales`): read
them as GGML MXFP4 blocks, one QuantizedTensor per expert and part, so they take the path every GGML type takes
(run natively where the kernels have MXFP4, dequantized at load otherwise).

    HF:   blocks (E, N, K/32, 16) uint8, byte j = element 2j (low nibble) | element 2j+1 (high nibble)
          scales (E, N, K/32) uint8, e8m0: 2^(s - 127); rows N = output features (gate|up interleaved)
    GGML: per 32 values one byte e (the same e8m0 byte) then 16 bytes, byte j = element j | element j+16 << 4

The same bits, re-arranged (llama.cpp's converter, conversion/gpt_oss.py, does the same).
"""

from __future__ import annotations

import gguf
import torch

from conveyor.loading.checkpoint import QuantizedTensor

MXFP4 = int(gguf.GGMLQuantizationType.MXFP4)


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., K/32, 16) HF nibbles + (..., K/32) scales -> (..., K/32 * 17) GGML MXFP4 rows."""
    low, high = blocks & 0x0F, blocks >> 4  # elements 2j and 2j+1
    values = torch.stack([low, high], dim=-1).flatten(-2)  # (..., K/32, 32) in element order
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2)


def split_experts(blocks: torch.Tensor, scales: torch.Tensor, pieces: int) -> list[list[QuantizedTensor]]:
    """Per expert, its `pieces` parts (gate and up alternate rows when 2; down is 1) as QuantizedTensors."""
    num_experts, rows, groups, _ = blocks.shape
    raw = ggml_blocks(blocks, scales)  # (E, N, row_bytes)
    out = []
    for e in range(num_experts):
        parts = [raw[e, p::pieces].contiguous() for p in range(pieces)]
        out.append([QuantizedTensor(MXFP4, (rows // pieces, groups * 32), part) for part in parts])
    return out
