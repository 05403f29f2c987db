"""Checkpoint tensors -> what a model keeps: GGML blocks for the quantized kernel, else dense (packed) weights.

`--weight-dtype` decides, per tensor, as the model loads it (so no more than one tensor is ever
converted at a time, and the file's pages are released right after):

  auto   GGML blocks of a type the backend runs (Q8_0, Q4_K, ...) stay blocks; the rest is dense
  bf16   everything dense in the model dtype (GGUF blocks dequantized): the pre-quantization path
  int8   dense, then weight-only int8 linears (torch's int8 GEMM)
  q8_0, q4_0  float linears and embeddings quantized to that type at load (gguf-py), then as auto

Blocks only run with bf16 activations on the CPU kernels; elsewhere they are dequantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.kernels.quant_ref import Q, block_shape, quantize_raw
from conveyor.models.tensors import QuantizedTensor, Weight
from conveyor.models.layers import (QuantizedEmbedding, RowInvariantLinear, TiedPackedEmbedding, dtype_name,
                                    pack_segments)

logger = logging.getLogger(__name__)

_QUANTIZE_TO = {"q8_0": int(Q.Q8_0), "q4_0": int(Q.Q4_0)}


def _keep_pages(tensor: torch.Tensor) -> None:
    return None


@dataclass(frozen=True)
class WeightLoader:
    """Converts one checkpoint tensor at a time into what a module keeps, releasing the source after."""

    ops: KernelBackend
    dtype: torch.dtype
    device: torch.device
    weight_dtype: str = "auto"
    release: Callable[[torch.Tensor], None] = _keep_pages  # Checkpoint.release_pages

    @property
    def runs_blocks(self) -> bool:
        """Whether GGML blocks can run here at all (the quantized kernel takes bf16 activations, on CPU)."""
        return (self.dtype == torch.bfloat16 and self.device.type == "cpu"
                and self.weight_dtype not in ("bf16", "int8"))

    def dense(self, tensor: Weight) -> torch.Tensor:
        """A fresh copy in the model dtype on the model device (blocks dequantized, one tensor at a time)."""
        if isinstance(tensor, QuantizedTensor):
            out = tensor.dequantize().to(self.device, self.dtype)
            self.release(tensor.raw)
            return out
        # contiguous: a stacked expert's view may be transposed (Llama 4)
        out = tensor.to(self.device, self.dtype, copy=True, memory_format=torch.contiguous_format)
        self.release(tensor)
        return out

    def blocks(self, tensor: Weight) -> QuantizedTensor | None:
        """The GGML form this tensor runs in here, or None (it runs dense)."""
        if not self.runs_blocks:
            return None
        if isinstance(tensor, QuantizedTensor):
            return tensor if self.ops.runs_quantized(tensor.qtype) else None
        target = _QUANTIZE_TO.get(self.weight_dtype)
        if (target is None or tensor.dim() != 2 or tensor.shape[1] % block_shape(target)[0]
                or not self.ops.runs_quantized(target)):
            return None
        quantized = QuantizedTensor(target, tuple(tensor.shape), quantize_raw(tensor, target))
        self.release(tensor)
        return quantized

    def param(self, tensor: Weight) -> nn.Parameter:
        return nn.Parameter(self.dense(tensor), requires_grad=False)

    def linear(self, linear: RowInvariantLinear, parts: list[Weight], bias_parts: list[Weight] | None = None) -> None:
        """Fill a (possibly fused) linear from its parts, stacked by output rows."""
        if bias_parts:
            linear.bias = self.param(torch.cat([self.dense(b) for b in bias_parts]))  # before the weight: packs add it
        blocks = [self.blocks(p) for p in parts]
        if all(b is not None for b in blocks):
            linear.load_quantized(pack_segments(blocks, self.ops))
            for b in blocks:
                self.release(b.raw)
            return
        weight = self.dense(parts[0]) if len(parts) == 1 else torch.cat([self.dense(p) for p in parts])
        self.dense_linear(linear, weight)

    def dense_linear(self, linear: RowInvariantLinear, weight: torch.Tensor) -> None:
        """Hold `weight`, then pack it (or make it int8) and let the dense copy go."""
        linear.load_dense(weight)
        if self.weight_dtype == "int8" and linear.quantize_int8():
            return
        linear.prepack()

    def embedding(self, tensor: Weight) -> nn.Module:
        """Token embeddings: GGML blocks gathered row by row where they run, else a dense nn.Embedding."""
        vocab, hidden = tensor.shape
        blocks = self.blocks(tensor)
        if blocks is not None:
            (segment,) = pack_segments([blocks], self.ops)
            self.release(blocks.raw)
            return QuantizedEmbedding(segment, hidden, self.ops)
        module = nn.Embedding(vocab, hidden, device="meta")
        module.weight = self.param(tensor)
        return module

    def tie(self, head: RowInvariantLinear, embedding: nn.Module) -> nn.Module:
        """A tied lm_head and its embedding share one copy: the same packed blocks, or the head's packed bf16
        weight, from which the embedding then gathers its rows. Returns the embedding module to keep."""
        if isinstance(embedding, QuantizedEmbedding):
            head.load_quantized((embedding.segment,))
            return embedding
        self.dense_linear(head, embedding.weight.data)
        if head.gather_rows(torch.zeros(1, dtype=torch.long)) is None:
            return embedding  # not packed by our GEMM (int8, oneDNN, off CPU): the embedding keeps its own
        return TiedPackedEmbedding(head)


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Bytes the model's weights hold, by format (Q4_K, BF16, ...); a tensor shared by two modules counts once."""
    seen: set[tuple] = set()
    totals: dict[str, int] = {}
    for module in model.modules():
        if hasattr(module, "stored_weights"):
            kept = module.stored_weights()
        else:
            kept = [(dtype_name(p.dtype), p) for p in module.parameters(recurse=False)]
        for fmt, tensor in kept:
            key = _storage_key(tensor)
            if key in seen:
                continue
            seen.add(key)
            totals[fmt] = totals.get(fmt, 0) + tensor.numel() * tensor.element_size()
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _storage_key(tensor: torch.Tensor) -> tuple:
    try:  # two Parameters over one storage (a tied head left unpacked) are one tensor
        return (tensor.data_ptr(), tensor.numel(), tensor.dtype)
    except RuntimeError:  # opaque tensors (oneDNN) have no data pointer
        return (id(tensor),)


def describe_formats(totals: dict[str, int]) -> str:
    """`Q4_K 512.3 MiB, Q6_K 104.1 MiB, F32 0.1 MiB`."""
    return ", ".join(f"{fmt} {size / 2**20:.1f} MiB" for fmt, size in totals.items())


def count_params(model: nn.Module, tied: bool) -> int:
    """Weights as model cards count them, whatever their format: a tied head is the embedding, counted once."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, RowInvariantLinear):
            if not (tied and name == "lm_head"):
                total += module.in_features * module.out_features + (module.out_features if module.bias is not None else 0)
        elif isinstance(module, (QuantizedEmbedding, TiedPackedEmbedding)):
            total += module.num_embeddings * module.embedding_dim
        else:
            total += sum(p.numel() for p in module.parameters(recurse=False))
    return total


def tensor_getters(weights: Mapping[str, Weight], loader: WeightLoader,
                   norm_weight_offset: float) -> tuple[Callable[[str], Weight], Callable[[str], nn.Parameter]]:
    """(get, norm) for a model's load_weights: a tensor by HF name (a KeyError naming it when missing), and an
    RMSNorm weight with the family's (1 + w) offset folded in once (Gemma, Qwen3.5)."""

    def get(name: str) -> Weight:
        if name not in weights:
            raise KeyError(f"checkpoint is missing tensor {name}")
        return weights[name]

    def norm(name: str) -> nn.Parameter:
        weight = loader.param(get(name))
        if norm_weight_offset:
            weight.data += norm_weight_offset
        return weight

    return get, norm


def load_ends(model: nn.Module, weights: Mapping[str, Weight], loader: WeightLoader, get: Callable[[str], Weight],
              norm: Callable[[str], nn.Parameter], embedding: str = "model.embed_tokens.weight",
              final_norm: str = "model.norm.weight") -> None:
    """A decoder's two ends: the token embedding, the final norm and the head (tied to the embedding when the
    config says so or the checkpoint has no lm_head.weight)."""
    model.embed_tokens = loader.embedding(get(embedding))
    model.norm.weight = norm(final_norm)
    if model.config.tie_word_embeddings or "lm_head.weight" not in weights:
        model.embed_tokens = loader.tie(model.lm_head, model.embed_tokens)
    else:
        loader.linear(model.lm_head, [get("lm_head.weight")])
