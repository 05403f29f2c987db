"""Loading the drafter of speculation: a draft model checked against the target, or the target's own MTP head."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.config import EngineConfig
from conveyor.kernels import KernelBackend
from conveyor.loading import Checkpoint, LoadError, load_checkpoint
from conveyor.loading.checkpoint import unstack_experts
from conveyor.loading.pairing import check_draft_pairing
from conveyor.models import mtp
from conveyor.models.config import ModelConfig
from conveyor.models.hybrid_layout import FAMILY_NAMES
from conveyor.models.registry import build_model, set_row_tiles
from conveyor.models.weights import WeightLoader

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
    if config.draft_kind in ("none", "prompt-lookup", "mtp") or (draft_checkpoint is None
                                                                  and config.draft_model is None):
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


def load_mtp_head(config: EngineConfig, target: Checkpoint, model: nn.Module, dtype: torch.dtype,
                  device: torch.device, ops: KernelBackend) -> DraftModel | None:
    """The target's multi-token-prediction head (models/mtp.py) for --draft-kind mtp; else None. A target without
    one is refused (LoadError): MTP drafting needs the mtp.* tensors Qwen3.5 / Qwen3-Next checkpoints carry."""
    if config.draft_kind != "mtp":
        return None
    cfg = target.config
    if not mtp.has_mtp(target.mtp_weights) or cfg.architecture not in FAMILY_NAMES:
        raise LoadError(f"--draft-kind mtp: {target.name} has no multi-token-prediction head (the mtp.* tensors of "
                        "Qwen3.5 / Qwen3-Next checkpoints, or a GGUF's nextn blocks); use --draft-kind prompt-lookup "
                        "or --draft-model PATH")
    if not ops.speculation:
        logger.warning("--draft-kind mtp ignored: speculation needs a batch-invariant backend (this one: %s)", ops.name)
        return None
    weights = unstack_experts(mtp.layer_config(cfg), mtp.layer_weights(cfg, target.mtp_weights), target.source)
    head = mtp.MTPHead(cfg, ops, model)
    try:
        head.load_weights(weights, WeightLoader(ops, dtype, device, config.weight_dtype, target.release_pages))
    except KeyError as exc:
        raise LoadError(f"--draft-kind mtp: the MTP head of {target.name} is incomplete ({exc.args[0]})") from None
    head.eval()
    if config.batch_invariant:
        set_row_tiles(head)
    logger.info("MTP head of %s proposes %d tokens per row", target.name, config.draft_block_size)
    return DraftModel(f"{target.name}:mtp", cfg, head)
