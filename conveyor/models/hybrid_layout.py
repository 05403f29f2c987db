"""Which mixers a hybrid model's layers hold and where its checkpoint keeps their tensors.

Plain names, no modules: the loader checks a checkpoint against `weight_names` before any model is
built, and models/hybrid.py builds and loads each mixer from the same `sublayers`. Each family file's
NAMES says, per layer kind, the layer's pre-norm residual steps as (norm, mixers) and, per mixer, its
kind and tensor names; a step with several mixers runs them side by side on the normed input and sums
their outputs (Falcon-H1's Mamba2 and attention, Granite's experts and shared MLP). An entry of a step's
mixers may be a tuple of alternatives, of which the first present one runs (LFM2-MoE, Qwen3-Next:
`("experts", "mlp")`, the experts in MoE layers and the MLP in the dense ones).

Mixers of kind "moe" (models/moe.py's sparse block) are present only in the layers `config.is_moe_layer`
names; their tensor names are the family's expert_names (models/family.py) under the layer's prefix.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from conveyor.models import falcon_h1, granite_hybrid, lfm2, mamba2, nemotron_h, qwen3_5, qwen3_next
from conveyor.models import family as families
from conveyor.models.config import ModelConfig

FAMILY_NAMES: dict[str, dict[str, Any]] = {
    "lfm2": lfm2.NAMES, "lfm2_moe": lfm2.NAMES, "qwen3_5_text": qwen3_5.NAMES, "qwen3_5_moe_text": qwen3_5.NAMES,
    "qwen3_next": qwen3_next.NAMES, "granitemoehybrid": granite_hybrid.NAMES, "nemotron_h": nemotron_h.NAMES,
    "falcon_h1": falcon_h1.NAMES, "mamba2": mamba2.NAMES,
}


@dataclass(frozen=True)
class MixerSpec:
    kind: str  # attention | short_conv | gated_deltanet | mamba2 | mlp | moe
    names: dict[str, str]  # role -> HF name under `prefix` (the family's NAMES entry)

    @property
    def prefix(self) -> str:
        return self.names["prefix"]


@dataclass(frozen=True)
class Sublayer:
    """One pre-norm residual step of a layer: x + sum of its mixers(norm(x))."""

    norm: str  # the norm's HF name under the layer prefix
    mixers: tuple[MixerSpec, ...]


def sublayers(config: ModelConfig, layer: int) -> list[Sublayer]:
    names = FAMILY_NAMES[config.architecture]
    steps = []
    kind = config.layer_kind(layer)
    if kind == "sliding_attention" and kind not in names["layout"]:
        kind = "full_attention"  # the window is the attention's own setting; the layer's steps are the same
    for norm, entries in names["layout"][kind]:
        mixers = []
        for entry in entries:
            present = [m for m in ((entry,) if isinstance(entry, str) else entry) if _present(config, layer, names[m])]
            if present:
                mixers.append(MixerSpec(names[present[0]]["kind"], names[present[0]]))
        if not mixers:
            raise ValueError(f"{config.architecture} layer {layer}: the step after {norm} has no mixer")
        steps.append(Sublayer(norm, tuple(mixers)))
    return steps


def _present(config: ModelConfig, layer: int, names: dict[str, str]) -> bool:
    """Experts run only in MoE layers (Granite's dense models keep just the shared MLP; LFM2-MoE and Qwen3-Next
    keep dense MLPs in some layers)."""
    return names["kind"] != "moe" or config.is_moe_layer(layer)


def embedding_name(config: ModelConfig) -> str:
    return FAMILY_NAMES[config.architecture]["embed"]


def final_norm_name(config: ModelConfig) -> str:
    return FAMILY_NAMES[config.architecture]["final_norm"]


def layer_prefix(config: ModelConfig, layer: int) -> str:
    return f"{FAMILY_NAMES[config.architecture]['layers']}{layer}."


def mixer_tensors(config: ModelConfig, spec: MixerSpec, available: Collection[str] = (), prefix: str = "") -> list[str]:
    """The mixer's tensor names under its prefix; `available` (full names, the mixer's under `prefix`) picks
    between layouts a family's checkpoints come in."""
    n, kind = spec.names, spec.kind
    if kind == "attention":
        out = [f"{n[p]}.weight" for p in ("q", "k", "v", "o")]
        if config.qk_norm:
            out += [f"{n['q_norm']}.weight", f"{n['k_norm']}.weight"]
        if config.attention_bias:
            out += [f"{n[p]}.bias" for p in ("q", "k", "v")]
        return out
    if kind == "short_conv":
        out = [f"{n[p]}.weight" for p in ("in", "out", "conv")]
        return out + ([f"{n[p]}.bias" for p in ("in", "out", "conv")] if config.conv_bias else [])
    if kind == "gated_deltanet":
        # Qwen3-Next's HF checkpoints pack them by key head; its GGUF files hold them split, as Qwen3.5's
        packed = "qkvz" in n and f"{prefix}{n['qkv']}.weight" not in available
        projections = ("qkvz", "ba") if packed else ("qkv", "z", "b", "a")
        return [f"{n[p]}.weight" for p in (*projections, "conv", "out", "norm")] + ["A_log", "dt_bias"]
    if kind == "mamba2":
        out = [f"{n[p]}.weight" for p in ("in", "conv", "out")] + ["A_log", "D", "dt_bias"]
        out += [f"{n['norm']}.weight"] if config.mamba_rms_norm else []
        out += [f"{n['conv']}.bias"] if config.conv_bias else []
        return out + ([f"{n[p]}.bias" for p in ("in", "out")] if config.mamba_proj_bias else [])
    if kind == "mlp":  # gate and up apart, fused (Granite's input_linear), or up alone (relu^2)
        return [f"{n[p]}.weight" for p in ("gate", "gate_up", "up", "down") if p in n]
    if kind == "moe":
        return moe_tensors(config)
    raise ValueError(f"unknown mixer kind {kind!r}")


def moe_tensors(config: ModelConfig) -> list[str]:
    """A sparse MoE block's tensor names under its layer's prefix (checkpoint.unstack_experts has split stacked
    experts into these per-expert names by then)."""
    n = families.expert_names(config.architecture)
    parts = ("up", "down") if config.hidden_act == "relu2" else ("gate", "up", "down")
    out = [n.router("")] + [n.expert("", e, part) for e in range(config.num_experts) for part in parts]
    if config.shared_expert_intermediate_size:
        out += [n.shared("", part) for part in parts]
        out += [n.shared_gate("")] if config.shared_expert_gate else []
    if config.moe_expert_bias:
        out.append(n.expert_bias(""))
    return out


def weight_names(config: ModelConfig, available: Collection[str] = ()) -> list[str]:
    names = [embedding_name(config), final_norm_name(config)]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        prefix = layer_prefix(config, i)
        for sub in sublayers(config, i):
            names.append(f"{prefix}{sub.norm}.weight")
            names += [f"{prefix}{spec.prefix}{t}" for spec in sub.mixers
                      for t in mixer_tensors(config, spec, available, prefix + spec.prefix)]
    return names
