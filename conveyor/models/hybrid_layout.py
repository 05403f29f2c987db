"""Which mixers a hybrid model's layers hold and where its checkpoint keeps their tensors.

Plain names, no modules: the loader checks a checkpoint against `weight_names` before any model is
built, and models/hybrid.py builds and loads each mixer from the same `sublayers`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from conveyor.models import lfm2, qwen3_5, qwen3_next
from conveyor.models.config import EXPERT_NAMES, ModelConfig

# Per family: HF tensor names of each mixer kind (relative to the mixer's prefix) and of the norms.
FAMILY_NAMES: dict[str, dict[str, Any]] = {"lfm2": lfm2.NAMES, "qwen3_5_text": qwen3_5.NAMES,
                                           "qwen3_next": qwen3_next.NAMES, "qwen3_5_moe_text": qwen3_5.NAMES,
                                           "lfm2_moe": lfm2.NAMES}

# layer_types value -> the token mixer that runs it
TOKEN_MIXERS = {"full_attention": "attention", "sliding_attention": "attention", "conv": "short_conv",
                "linear_attention": "gated_deltanet"}


@dataclass(frozen=True)
class Sublayer:
    """One pre-norm residual step of a layer: x + mixer(norm(x))."""

    norm: str  # the norm's HF name under the layer prefix
    kind: str  # attention | short_conv | gated_deltanet | mlp | moe
    names: dict[str, str]  # role -> HF name under `prefix` (FAMILY_NAMES)

    @property
    def prefix(self) -> str:
        return self.names["prefix"]


def sublayers(config: ModelConfig, layer: int) -> list[Sublayer]:
    names = FAMILY_NAMES[config.architecture]
    token = TOKEN_MIXERS[config.layer_kind(layer)]
    token_norm, channel_norm = names["norms"]
    return [Sublayer(token_norm, token, names[token]), _channel_mixer(config, layer, channel_norm)]


def _channel_mixer(config: ModelConfig, layer: int, norm: str) -> Sublayer:
    if config.is_moe_layer(layer):  # the sparse block's names are EXPERT_NAMES', under the layer's prefix
        return Sublayer(norm, "moe", {"prefix": ""})
    return Sublayer(norm, "mlp", FAMILY_NAMES[config.architecture]["mlp"])


def final_norm_name(config: ModelConfig) -> str:
    return FAMILY_NAMES[config.architecture]["final_norm"]


def mixer_tensors(config: ModelConfig, sub: Sublayer, available: Collection[str] = (), prefix: str = "") -> list[str]:
    """The mixer's tensor names under its prefix; `available` (full names, the mixer's under `prefix`) picks
    between layouts a family's checkpoints come in."""
    n = sub.names
    if sub.kind == "attention":
        out = [f"{n[p]}.weight" for p in ("q", "k", "v", "o")]
        if config.qk_norm:
            out += [f"{n['q_norm']}.weight", f"{n['k_norm']}.weight"]
        if config.attention_bias:
            out += [f"{n[p]}.bias" for p in ("q", "k", "v")]
        return out
    if sub.kind == "short_conv":
        out = [f"{n[p]}.weight" for p in ("in", "out", "conv")]
        return out + ([f"{n[p]}.bias" for p in ("in", "out", "conv")] if config.conv_bias else [])
    if sub.kind == "gated_deltanet":
        # Qwen3-Next's HF checkpoints pack them by key head; its GGUF files hold them split, as Qwen3.5's
        packed = "qkvz" in n and f"{prefix}{n['qkv']}.weight" not in available
        projections = ("qkvz", "ba") if packed else ("qkv", "z", "b", "a")
        return [f"{n[p]}.weight" for p in (*projections, "conv", "out", "norm")] + ["A_log", "dt_bias"]
    if sub.kind == "mlp":
        return [f"{n[p]}.weight" for p in ("gate", "up", "down")]
    if sub.kind == "moe":
        return moe_tensors(config)
    raise ValueError(f"unknown mixer kind {sub.kind!r}")


def moe_tensors(config: ModelConfig) -> list[str]:
    """A sparse MoE block's tensor names under its layer's prefix."""
    n = EXPERT_NAMES[config.architecture]
    out = [n.router("")] + [n.expert("", e, part) for e in range(config.num_experts) for part in ("gate", "up", "down")]
    if config.shared_expert_intermediate_size:
        out += [n.shared("", part) for part in ("gate", "up", "down")] + [n.shared_gate("")]
    if config.moe_expert_bias:
        out.append(n.expert_bias(""))
    return out


def weight_names(config: ModelConfig, available: Collection[str] = ()) -> list[str]:
    names = ["model.embed_tokens.weight", final_norm_name(config)]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for sub in sublayers(config, i):
            names.append(f"{prefix}{sub.norm}.weight")
            names += [f"{prefix}{sub.prefix}{t}" for t in mixer_tensors(config, sub, available, prefix + sub.prefix)]
    return names
