"""What a loader returns: config, HF-named weights and tokenizer, plus the name checks both loaders share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection

import torch

from conveyor.loading.tokenizer import Tokenizer
from conveyor.models import family as families
from conveyor.models.config import ExpertNames, ModelConfig
from conveyor.models.mla_dims import mla_weight_names
from conveyor.models.pooling import PoolingConfig
from conveyor.multimodal.vision import VisionCheckpoint
from conveyor.models.tensors import QuantizedTensor, Weight  # noqa: F401 (the loaders' names for them)


class LoadError(Exception):
    """A checkpoint cannot be loaded; the message is one line, meant for the user."""


def _keep_pages(tensor: torch.Tensor) -> None:
    return None


@dataclass
class Checkpoint:
    config: ModelConfig
    # Hugging Face parameter names -> CPU tensors, or GGML blocks. GGUF tensors are read-only views of the file's
    # mapping: copy before writing.
    weights: dict[str, Weight]
    tokenizer: Tokenizer
    source: str  # resolved path
    name: str  # model id shown by /v1/models
    # Called with a tensor once the model holds its own copy: a GGUF loader drops those file pages from RSS.
    release_pages: Callable[[torch.Tensor], None] = field(default=_keep_pages, repr=False, compare=False)
    # An embedder or reranker: how its vectors are pooled (sentence-transformers' files, a GGUF's pooling_type);
    # None: a generating model (the --embeddings / --pooling flags may still pool it).
    pooling: PoolingConfig | None = None
    # A multi-token-prediction head beside the model (Qwen3.5 / Qwen3-Next: mtp.*, HF names): loaded only for
    # --draft-kind mtp (models/mtp.py); empty when the checkpoint has none.
    mtp_weights: dict[str, Weight] = field(default_factory=dict, repr=False, compare=False)
    # A vision-language checkpoint's tower and projector (multimodal/vision.py); None for a text-only model.
    vision: VisionCheckpoint | None = field(default=None, repr=False, compare=False)


def expected_weight_names(config: ModelConfig, available: Collection[str] = ()) -> list[str]:
    """Every parameter a model built from `config` needs, in Hugging Face naming, the token embeddings first;
    q|k|v and gate|up may come fused (Phi-3) where `available` has them so."""
    family = families.get(config.architecture)
    if family is not None and family.hybrid:
        from conveyor.models.hybrid_layout import weight_names

        return weight_names(config, available)
    if family is not None and family.weight_names is not None:
        return family.weight_names(config) + [name for name in family.optional_weights if name in available]
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        if config.mla is not None:  # DeepSeek-V3's latent attention
            names += mla_weight_names(f"{layer}.self_attn.", config.mla, available)
        elif f"{layer}.self_attn.qkv_proj.weight" in available:
            names += [f"{layer}.self_attn.qkv_proj.weight", f"{layer}.self_attn.o_proj.weight"]
        else:
            names += [f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"]
        if config.is_moe_layer(i):
            experts = families.expert_names(config.architecture)
            names.append(experts.router(f"{layer}."))
            if config.moe_expert_bias:  # DeepSeek-V3's e_score_correction_bias
                names.append(experts.expert_bias(f"{layer}."))
            names += [experts.expert(f"{layer}.", e, part) for e in range(config.num_experts)
                      for part in ("gate", "up", "down")]
            if config.moe_linear_bias:  # GPT-OSS
                names.append(experts.router_bias(f"{layer}."))
                names += [experts.expert_linear_bias(f"{layer}.", e, part) for e in range(config.num_experts)
                          for part in ("gate", "up", "down")]
            if config.shared_expert_intermediate_size:  # Llama 4
                names += [experts.shared(f"{layer}.", part) for part in ("gate", "up", "down")]
                if config.shared_expert_gate:
                    names.append(experts.shared_gate(f"{layer}."))
        elif config.hidden_act == "xielu":  # Apertus: no gate; the activation's scalars
            names += [f"{layer}.mlp.{p}_proj.weight" for p in ("up", "down")]
            names += [f"{layer}.mlp.act_fn.{p}" for p in ("alpha_p", "alpha_n", "beta", "eps")]
        elif f"{layer}.mlp.gate_up_proj.weight" in available:
            names += [f"{layer}.mlp.gate_up_proj.weight", f"{layer}.mlp.down_proj.weight"]
        else:
            names += [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        if config.mlp_bias:
            names += [f"{layer}.mlp.{p}_proj.bias" for p in (("up", "down") if config.hidden_act == "xielu"
                                                               else ("gate", "up", "down"))]
        names += [f"{layer}.{norm}.weight" for norm in config.layer_norm_names]
        if config.attention_bias:
            names += [f"{layer}.self_attn.{p}_proj.bias" for p in "qkv"]
        if config.attention_out_bias:
            names.append(f"{layer}.self_attn.o_proj.bias")
        if config.qk_norm:
            names += [f"{layer}.self_attn.{p}_norm.weight" for p in "qk"]
        if config.attention_sinks:
            names.append(f"{layer}.self_attn.sinks")
    return names


def unstack_experts(config: ModelConfig, weights: dict[str, Weight], source: str) -> dict[str, Weight]:
    """Experts stacked one tensor per layer and part (Qwen3.5-MoE on the Hub, Granite 4.0-H: gate|up (E, 2I, H),
    down (E, H, I); Llama 4 and GPT-OSS inputs first, GPT-OSS with gate and up interleaved and stacked biases) as the
    per-expert tensors the models load: views, no copy. GPT-OSS's MXFP4 stacks become GGML blocks (a copy)."""
    names = families.expert_names(config.architecture) if config.num_experts else None
    if names is None or not any(name.endswith(("." + names.stacked("", "down"), ".experts.down_proj_blocks"))
                                for name in weights):
        return weights
    out = dict(weights)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        transposed = names.stacked_transposed
        down = out.get(names.stacked(prefix, "down"))
        if names.stacked_layout_by_shape and isinstance(down, torch.Tensor) and down.dim() == 3:
            transposed = tuple(down.shape[1:]) == (config.moe_intermediate_size, config.hidden_size)
        for part, pieces in (("gate_up", ("gate", "up")), ("down", ("down",))):
            _unstack_mxfp4(out, names, prefix, part, pieces, source)
            stacked = out.pop(names.stacked(prefix, part), None)
            if stacked is not None:
                if not isinstance(stacked, torch.Tensor) or stacked.dim() != 3 or len(stacked) != config.num_experts:
                    raise LoadError(f"{source}: {names.stacked(prefix, part)} is not ({config.num_experts}, N, K)")
                if transposed:  # Llama 4: inputs first, (E, H, 2I) and (E, I, H)
                    stacked = stacked.transpose(1, 2)
                for piece, tensors in zip(pieces, _split_stack(stacked, len(pieces), names.stacked_interleaved)):
                    out.update({names.expert(prefix, e, piece): tensor for e, tensor in enumerate(tensors)})
            bias = out.pop(names.stacked(prefix, part) + "_bias", None)  # GPT-OSS: (E, 2I) and (E, H)
            if bias is not None:
                for piece, tensors in zip(pieces, _split_stack(bias, len(pieces), names.stacked_interleaved)):
                    out.update({names.expert_linear_bias(prefix, e, piece): t for e, t in enumerate(tensors)})
    return out


def _unstack_mxfp4(weights: dict[str, Weight], names: ExpertNames, prefix: str, part: str, pieces: tuple[str, ...],
                   source: str) -> None:
    """GPT-OSS on the Hub: `{part}_blocks` / `_scales` (MXFP4, rows = outputs) -> one GGML-block tensor per expert."""
    blocks = weights.pop(names.stacked(prefix, part) + "_blocks", None)
    scales = weights.pop(names.stacked(prefix, part) + "_scales", None)
    if blocks is None and scales is None:
        return
    if blocks is None or scales is None or blocks.dim() != 4 or tuple(blocks.shape[:3]) != tuple(scales.shape):
        raise LoadError(f"{source}: {names.stacked(prefix, part)} MXFP4 blocks and scales do not match")
    from conveyor.loading.mxfp4_experts import split_experts  # NOTE: it builds on this module's QuantizedTensor

    for e, tensors in enumerate(split_experts(blocks, scales, len(pieces))):
        weights.update({names.expert(prefix, e, piece): tensor for piece, tensor in zip(pieces, tensors)})


def _split_stack(stacked: torch.Tensor, pieces: int, interleaved: bool) -> tuple[torch.Tensor, ...]:
    """Dim 1 of an expert stack in `pieces` parts: halves, or (GPT-OSS) alternate rows, gate first."""
    if interleaved and pieces == 2:
        return stacked[:, 0::2], stacked[:, 1::2]
    return stacked.chunk(pieces, dim=1)


def select_weights(config: ModelConfig, weights: dict[str, Weight], source: str) -> dict[str, Weight]:
    """Keep exactly the expected parameters; extras (a tied lm_head, rotary buffers) are dropped."""
    weights = unstack_experts(config, weights, source)
    names = expected_weight_names(config, weights.keys())
    missing = [name for name in names if name not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise LoadError(f"{source}: missing weights {', '.join(missing[:3])}{more}")
    embed = weights[names[0]]
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise LoadError(
            f"{source}: embedding shape {tuple(embed.shape)} does not match the config "
            f"(vocab_size={config.vocab_size}, hidden_size={config.hidden_size})"
        )
    return {name: weights[name] for name in names}
