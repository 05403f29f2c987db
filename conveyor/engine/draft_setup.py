"""Loading the draft model of draft-model speculation, checked against the target."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.config import EngineConfig
from conveyor.kernels import KernelBackend
from conveyor.loading import Checkpoint, load_checkpoint
from conveyor.loading.pairing import check_draft_pairing
from conveyor.models.config import ModelConfig
from conveyor.models.registry import build_model

logger = logging.getLogger(__name__)


@dataclass
class DraftModel:
    name: str
    config: ModelConfig
    model: nn.Module


def load_draft_model(config: EngineConfig, target: Checkpoint, draft_checkpoint: Checkpoint | None,
                     dtype: torch.dtype, device: torch.device, ops: KernelBackend) -> DraftModel | None:
    """The draft model when --draft-model (or a checkpoint) is given and --draft-kind allows it; else None.
    A draft whose tokenizer differs from the target's is refused (LoadError) before anything runs."""
    if config.draft_kind in ("none", "prompt-lookup") or (draft_checkpoint is None and config.draft_model is None):
        return None
    if not ops.speculation:
        logger.warning("--draft-model ignored: speculation needs a batch-invariant backend (this one: %s)", ops.name)
        return None
    draft = draft_checkpoint or load_checkpoint(config.draft_model)
    check_draft_pairing(target, draft)
    model = build_model(draft.config, draft.weights, dtype, device, config.batch_invariant, config.weight_dtype, ops=ops,
                        release=draft.release_pages)
    logger.info("draft model %s (%d layers) proposes %d tokens per row", draft.name,
                draft.config.num_hidden_layers, config.draft_block_size)
    return DraftModel(draft.name, draft.config, model)
