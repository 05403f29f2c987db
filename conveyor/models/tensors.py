"""The weights a model is built from: torch tensors, or GGML-quantized blocks as a file holds them. The loaders
produce them and the models consume them; neither layer owns the other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch

from conveyor.kernels.quant_ref import dequantize_raw, row_bytes, type_name


@dataclass(frozen=True)
class QuantizedTensor:
    """A (N, K) weight in GGML blocks: `raw` (N, row_bytes) uint8, row n = output feature n, as the file has it.

    From a GGUF file `raw` is a read-only view of the file's mapping (no copy); it is only read.
    """

    qtype: int  # GGML type id (gguf.GGMLQuantizationType)
    shape: tuple[int, int]  # (N, K), Hugging Face order
    raw: torch.Tensor = field(repr=False)

    def __post_init__(self) -> None:
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != (self.shape[0], row_bytes(self.qtype, self.shape[1])):
            raise ValueError(f"{self.type_name} {self.shape}: raw rows {tuple(self.raw.shape)} {self.raw.dtype}")

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dim(self) -> int:
        return 2

    def dequantize(self) -> torch.Tensor:
        """fp32 (N, K), by gguf-py."""
        return dequantize_raw(self.raw, self.qtype, self.shape[1])


Weight = Union[torch.Tensor, QuantizedTensor]
