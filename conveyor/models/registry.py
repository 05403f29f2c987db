"""Architecture name -> model class, and building a model ready to run."""

from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels import KernelBackend, resolve_backend
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.layers import RotaryEmbedding, RowInvariantLinear, calibrate_row_tile
from conveyor.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device, batch_invariant: bool = True, weight_dtype: str = "auto",
                ops: KernelBackend | None = None) -> nn.Module:
    """A model ready to run on `ops` (resolved here for `device` when not given)."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ModelConfigError(f"no model implementation for architecture {config.architecture!r}")
    ops = ops if ops is not None else resolve_backend(device, dtype, batch_invariant=batch_invariant)
    with torch.device("meta"):
        model = cls(config, ops)
    # Materialize on the target device, then copy the checkpoint in.
    model = model.to_empty(device=device).to(dtype)
    # Buffers computed in __init__ were lost on the meta device; rebuild the rotary tables for real.
    model.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                   config.rope_scaling).to(device)
    model.load_hf_weights(weights)
    model.eval()
    for module in model.modules():
        if isinstance(module, RowInvariantLinear):
            if weight_dtype == "int8" and module.quantize_int8():
                continue
            module.prepack()
    if batch_invariant:
        set_row_tiles(model)
    return model


def set_row_tiles(model: nn.Module) -> dict[tuple[int, int], int]:
    """Calibrate once per distinct weight shape (after prepacking) and store the tile in every linear.

    Linears on our own GEMM need no tile: it is row-invariant at every M by construction.
    """
    tiles: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, RowInvariantLinear) and not module.row_invariant_kernel:
            shape = tuple(module.weight.shape)
            if shape not in tiles:
                tiles[shape] = calibrate_row_tile(module)
            module.row_tile = tiles[shape]
    return tiles
