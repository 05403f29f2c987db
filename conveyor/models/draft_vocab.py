"""A draft vocabulary (FR-Spec, "frequency-ranked speculative sampling"): a drafter's LM head over a subset of the
target's token ids, so each draft reads N rows of the head instead of the whole vocabulary.

On a 248k-token vocabulary the target's head is most of a one-layer drafter's cost (Qwen3.5's MTP head: 13 of 16 ms
per draft on 2 cores, memory-bound). The subset's rows are gathered once at load into their own compact weight, in
the head's own format (GGML rows of a row-major type are whole blocks, so a row is a slice of bytes), and drafts
come from the subset only; the target verifies as before, so output never depends on it (a token outside the
subset is never drafted: its drafts are rejected, never wrong).
"""

from __future__ import annotations

import gguf
import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.kernels.quant_ref import quantize_raw
from conveyor.models.layers import RowInvariantLinear
from conveyor.models.tensors import QuantizedTensor, Weight
from conveyor.models.weights import WeightLoader


class DraftVocabHead(nn.Module):
    """lm_head rows `token_ids` (ascending target ids) as one compact linear: hidden (R, H) -> logits (R, N)."""

    def __init__(self, token_ids: torch.Tensor, hidden_size: int, ops: KernelBackend) -> None:
        super().__init__()
        # Ascending, so an argmax over the subset breaks ties toward the lower id, as one over the full vocabulary.
        assert bool((token_ids[1:] > token_ids[:-1]).all()), "draft vocabulary ids must be ascending and unique"
        self.lm_head = RowInvariantLinear(hidden_size, token_ids.shape[0], False, ops)
        self.register_buffer("token_ids", token_ids.long(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (R, H) -> float32 (R, N)
        return self.lm_head(hidden).float()

    def load(self, head_weight: Weight, loader: WeightLoader, row_type: str = "same") -> None:
        """From the target's full head weight (V, H) as the checkpoint holds it: its rows `token_ids`, copied, in
        its own format or requantized to `row_type` (--draft-vocab-type)."""
        rows = gather_rows(head_weight, self.token_ids.cpu())
        if row_type != "same":
            rows = requantize(rows, int(gguf.GGMLQuantizationType[row_type.upper()]))
        loader.linear(self.lm_head, [rows])
        self.token_ids = self.token_ids.to(loader.device)


def gather_rows(weight: Weight, row_ids: torch.Tensor) -> Weight:
    """Rows `row_ids` of a (V, H) weight, in its own format: GGML blocks stay blocks (a row is whole blocks)."""
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor(weight.qtype, (row_ids.shape[0], weight.shape[1]), weight.raw[row_ids].contiguous())
    return weight[row_ids].contiguous()


def requantize(weight: Weight, qtype: int) -> QuantizedTensor:
    """A (N, H) weight in GGML type `qtype`: a drafter's head is read once per draft, memory-bound, so fewer bytes
    per row are a faster draft (Q6_K -> Q4_0: 210 -> 144 bytes per 256 weights); its drafts may differ, output
    never does (the target verifies)."""
    values = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight.float()
    return QuantizedTensor(qtype, tuple(values.shape), quantize_raw(values, qtype))
