"""Building a model ready to run (its class: the family registry's, models/family.py)."""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Mapping

import torch
from torch import nn

from conveyor.kernels import KernelBackend, resolve_backend
from conveyor.models import family as families
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.layers import RotaryEmbedding, RowInvariantLinear, calibrate_row_tile
from conveyor.models.tensors import Weight
from conveyor.models.weights import WeightLoader

logger = logging.getLogger(__name__)


def build_model(config: ModelConfig, weights: Mapping[str, Weight], dtype: torch.dtype,
                device: torch.device, batch_invariant: bool = True, weight_dtype: str = "auto",
                ops: KernelBackend | None = None,
                release: Callable[[torch.Tensor], None] | None = None) -> nn.Module:
    """A model ready to run on `ops` (resolved here for `device` when not given).

    The large weights are built as meta placeholders, then each tensor is converted and assigned in turn
    (models/weights.py), so loading never holds a second full copy of the weights; `release`
    (Checkpoint.release_pages) gets each source tensor once the model has its own copy.
    """
    cls = families.model_class(config.architecture)
    if cls is None:
        raise ModelConfigError(f"no model implementation for architecture {config.architecture!r}")
    ops = ops if ops is not None else resolve_backend(device, dtype, batch_invariant=batch_invariant)
    # NOTE: not under `with torch.device("meta")`: that imports ~800 torch modules (~70 MB RSS) on first use.
    model = cls(config, ops)
    loader = WeightLoader(ops, dtype, device, weight_dtype, release or (lambda tensor: None))
    if weight_dtype in ("q8_0", "q4_0") and not loader.runs_blocks:
        logger.warning("--weight-dtype %s needs bf16 on the CPU kernels (here: %s on %s): weights stay %s",
                       weight_dtype, dtype, ops.name, dtype)
    model.load_weights(weights, loader)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):  # global and (Gemma 3) local tables
            module.to(device)
    left = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise ModelConfigError(f"weights never loaded: {', '.join(left[:3])}")
    model.eval()
    if batch_invariant:
        set_row_tiles(model)
    return model


def set_row_tiles(model: nn.Module) -> dict[tuple[int, int], int]:
    """Calibrate once per distinct weight shape (after prepacking) and store the tile in every linear.

    Linears on our own kernels need no tile: they are row-invariant at every M by construction.
    """
    tiles: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, RowInvariantLinear) and not module.row_invariant_kernel:
            shape = (module.out_features, module.in_features)
            if shape not in tiles:
                tiles[shape] = calibrate_row_tile(module)
            module.row_tile = tiles[shape]
    return tiles
