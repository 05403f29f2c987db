"""Loading the drafter of speculation: a draft model checked against the target, the target's own MTP head, or an
EAGLE3 or DFlash drafter (small checkpoints reading the target's hidden states)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from conveyor.config import EngineConfig
from conveyor.engine.draft_vocab import attach_draft_vocab
from conveyor.kernels import KernelBackend
from conveyor.loading import Checkpoint, LoadError, load_checkpoint
from conveyor.loading.checkpoint import unstack_experts
from conveyor.loading.pairing import check_draft_pairing
from conveyor.models import dflash, eagle3, family, mtp
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.models.llama import LlamaForCausalLM
from conveyor.models.hybrid_layout import FAMILY_NAMES
from conveyor.models.registry import build_model, set_row_tiles
from conveyor.models.weights import WeightLoader

logger = logging.getLogger(__name__)


@dataclass
class DraftModel:
    name: str
    config: ModelConfig
    model: nn.Module
    max_tokens: int = 16  # drafts per row it can propose (DFlash: its block size - 1)


def load_draft_model(config: EngineConfig, target: Checkpoint, draft_checkpoint: Checkpoint | None,
                     dtype: torch.dtype, device: torch.device, ops: KernelBackend) -> DraftModel | None:
    """The draft model when --draft-model (or a checkpoint) is given and --draft-kind allows it; else None.
    A draft whose tokenizer differs from the target's is refused (LoadError) before anything runs."""
    if config.draft_kind in ("none", "prompt-lookup", "mtp", "eagle3", "dflash") or (draft_checkpoint is None
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
    vocab = attach_draft_vocab(config, target, head, WeightLoader(ops, dtype, device, config.weight_dtype))
    head.eval()
    if config.batch_invariant:
        set_row_tiles(head)
    logger.info("MTP head of %s proposes %d tokens per row", target.name, config.draft_block_size)
    return DraftModel(f"{target.name}:mtp{vocab}", cfg, head)


def load_eagle3_head(config: EngineConfig, target: Checkpoint, model: nn.Module, dtype: torch.dtype,
                     device: torch.device, ops: KernelBackend) -> DraftModel | None:
    """The EAGLE3 drafter at --draft-model for --draft-kind eagle3 (models/eagle3.py); else None. A target that is
    not a plain dense decoder (Llama-family, Qwen3: the shared decoder) or a drafter of another hidden size is
    refused (LoadError)."""
    if config.draft_kind != "eagle3":
        return None
    cfg = target.config
    if family.model_class(cfg.architecture) is not LlamaForCausalLM:
        raise LoadError(f"--draft-kind eagle3: {target.name} ({cfg.architecture}) is not a dense decoder EAGLE3 "
                        "drafts for (Llama-family, Qwen3 and the other families on the shared decoder)")
    raw, weights = _read_eagle3_dir(config.draft_model)
    try:
        spec = eagle3.Eagle3Config.from_hf_dict(raw)
    except (ModelConfigError, KeyError, TypeError, ValueError) as exc:
        raise LoadError(f"--draft-kind eagle3: {config.draft_model}: {exc}") from None
    if spec.layer.hidden_size != cfg.hidden_size or spec.target_hidden_size != cfg.hidden_size:
        raise LoadError(f"--draft-kind eagle3: the drafter's hidden size {spec.layer.hidden_size} does not match "
                        f"{target.name}'s {cfg.hidden_size}")
    ids = spec.aux_layer_ids or eagle3.default_aux_layer_ids(cfg.num_hidden_layers)
    if len(ids) != 3 or not all(0 <= i <= cfg.num_hidden_layers for i in ids):
        raise LoadError(f"--draft-kind eagle3: aux hidden state layers {list(ids)} do not fit {target.name}'s "
                        f"{cfg.num_hidden_layers} layers (three ids in 0..{cfg.num_hidden_layers})")
    if not ops.speculation:
        logger.warning("--draft-kind eagle3 ignored: speculation needs a batch-invariant backend (this one: %s)",
                       ops.name)
        return None
    head = eagle3.Eagle3Head(spec, ids, cfg, ops, model)
    try:
        head.load_weights(eagle3.checkpoint_names(weights), WeightLoader(ops, dtype, device, config.weight_dtype))
    except KeyError as exc:
        raise LoadError(f"--draft-kind eagle3: {config.draft_model} is incomplete ({exc.args[0]})") from None
    except ModelConfigError as exc:
        raise LoadError(f"--draft-kind eagle3: {config.draft_model}: {exc}") from None
    head.eval()
    if config.batch_invariant:
        set_row_tiles(head)
    name = Path(config.draft_model).name
    logger.info("EAGLE3 drafter %s (draft vocabulary %d, target layers %s) proposes %d tokens per row", name,
                spec.draft_vocab_size, list(ids), config.draft_block_size)
    return DraftModel(f"{target.name}:eagle3:{name}", cfg, head)


def _read_eagle3_dir(path: str, kind: str = "eagle3") -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor of an EAGLE3 (or DFlash) drafter's directory (*.safetensors, else
    pytorch_model.bin)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise LoadError(f"--draft-kind {kind}: {path} is not a drafter's Hugging Face directory (no config.json)")
    raw = json.loads((folder / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            weights.update(load_file(str(file)))
    elif (folder / "pytorch_model.bin").is_file():  # EAGLE3's own releases (yuhuili/EAGLE3-*)
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise LoadError(f"--draft-kind {kind}: {path} has no *.safetensors or pytorch_model.bin")
    return raw, weights


def load_dflash_head(config: EngineConfig, target: Checkpoint, model: nn.Module, dtype: torch.dtype,
                     device: torch.device, ops: KernelBackend) -> DraftModel | None:
    """The DFlash drafter at --draft-model for --draft-kind dflash (models/dflash.py); else None. A target that is
    not a plain dense decoder, a drafter of another hidden size or one reading a layer the target lacks is refused
    (LoadError)."""
    if config.draft_kind != "dflash":
        return None
    cfg, where = target.config, f"--draft-kind dflash: {config.draft_model}"
    if family.model_class(cfg.architecture) is not LlamaForCausalLM:
        raise LoadError(f"--draft-kind dflash: {target.name} ({cfg.architecture}) is not a dense decoder DFlash "
                        "drafts for (Llama-family, Qwen3 and the other families on the shared decoder)")
    raw, weights = _read_eagle3_dir(config.draft_model, "dflash")
    try:
        spec = dflash.DFlashConfig.from_hf_dict(raw)
    except (ModelConfigError, KeyError, TypeError, ValueError) as exc:
        raise LoadError(f"{where}: {exc}") from None
    if spec.layer.hidden_size != cfg.hidden_size:
        raise LoadError(f"{where}: the drafter's hidden size {spec.layer.hidden_size} does not match "
                        f"{target.name}'s {cfg.hidden_size}")
    n = cfg.num_hidden_layers
    ids = spec.target_layer_ids or dflash.default_target_layer_ids(spec.num_target_layers or n,
                                                                    spec.layer.num_hidden_layers)
    if not ids or not all(0 <= i < n for i in ids):
        raise LoadError(f"{where}: target layers {list(ids)} do not fit {target.name}'s {n} layers (ids in 0..{n - 1})")
    if not 0 <= spec.mask_token_id < cfg.vocab_size or spec.block_size < 2:
        raise LoadError(f"{where}: mask token {spec.mask_token_id} outside {target.name}'s vocabulary "
                        f"({cfg.vocab_size}) or block size {spec.block_size} < 2")
    if not ops.speculation:
        logger.warning("--draft-kind dflash ignored: speculation needs a batch-invariant backend (this one: %s)",
                       ops.name)
        return None
    try:
        head = dflash.DFlashHead(spec, ids, cfg, ops, model)
        head.load_weights(dflash.checkpoint_names(weights), WeightLoader(ops, dtype, device, config.weight_dtype))
    except KeyError as exc:
        raise LoadError(f"{where} is incomplete ({exc.args[0]})") from None
    except ModelConfigError as exc:
        raise LoadError(f"{where}: {exc}") from None
    vocab = attach_draft_vocab(config, target, head, WeightLoader(ops, dtype, device, config.weight_dtype))
    head.eval()
    if config.batch_invariant:
        set_row_tiles(head)
    name = Path(config.draft_model).name
    drafts = min(config.draft_block_size, spec.block_size - 1)
    logger.info("DFlash drafter %s (%d layers, block %d, target layers %s) proposes %d tokens per row", name,
                spec.layer.num_hidden_layers, spec.block_size, list(ids), drafts)
    return DraftModel(f"{target.name}:dflash:{name}{vocab}", cfg, head, spec.block_size - 1)
