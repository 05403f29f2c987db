"""What a loader returns: config, HF-named weights and tokenizer, plus the name checks both loaders share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.loading.tokenizer import Tokenizer
from conveyor.models.config import ModelConfig


class LoadError(Exception):
    """A checkpoint cannot be loaded; the message is one line, meant for the user."""


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face parameter names, CPU tensors
    tokenizer: Tokenizer
    source: str  # resolved path
    name: str  # model id shown by /v1/models


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every parameter a Llama-family model built from `config` needs, in Hugging Face naming."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names += [f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"]
        if config.attention_bias:
            names += [f"{layer}.self_attn.{p}_proj.bias" for p in "qkv"]
        if config.qk_norm:
            names += [f"{layer}.self_attn.{p}_norm.weight" for p in "qk"]
    return names


def select_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Keep exactly the expected parameters; extras (a tied lm_head, rotary buffers) are dropped."""
    names = expected_weight_names(config)
    missing = [name for name in names if name not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise LoadError(f"{source}: missing weights {', '.join(missing[:3])}{more}")
    embed = weights["model.embed_tokens.weight"]
    if embed.shape != (config.vocab_size, config.hidden_size):
        raise LoadError(
            f"{source}: embedding shape {tuple(embed.shape)} does not match the config "
            f"(vocab_size={config.vocab_size}, hidden_size={config.hidden_size})"
        )
    return {name: weights[name] for name in names}
