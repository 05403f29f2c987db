"""Model families: what each architecture (a Hugging Face `model_type`) changes, declared by its own module.

A family module (models/gemma.py, models/qwen3_5.py, ...) ends with `register(Family(...))`: its config fields,
its tensor names where they differ from the shared decoder's, the model class that runs it, and how llama.cpp's
GGUF files of it read (their `general.architecture`, metadata and tensor names). The central config, the model
registry and the loaders look families up here and name none of them; the first lookup imports every family
module (models/families.py lists them), so adding a family is one new file and one line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    architecture: str  # the HF model_type
    model_class: str  # "module:Class" that runs it, imported when a model is built
    hf_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # raw HF config -> ModelConfig fields
    weight_renames: dict[str, str] = field(default_factory=dict)  # checkpoint name part -> the decoder's
    weight_names: Callable[[Any], list[str]] | None = None  # its own tensor list (layers unlike the decoder's)
    optional_weights: tuple[str, ...] = ()  # kept where a checkpoint has them, never required (an encoder's pooler)
    hybrid: bool = False  # pre-norm residual steps of attention / recurrent / channel mixers (models/hybrid.py)
    multimodal_type: str | None = None  # the model_type of the multimodal directory whose text part this is
    # What transformers' text config class fills in where a multimodal config.json's text_config is sparse (Gemma 3
    # 4B's names only what differs from Gemma3TextConfig's defaults)
    multimodal_text_defaults: dict[str, Any] = field(default_factory=dict)
    expert_names: Any = None  # config.ExpertNames: where its checkpoints keep the sparse MLP (MoE families)
    # llama.cpp's `general.architecture` values written for it (the first family that lists one loads it)
    gguf_architectures: tuple[str, ...] = ()
    # (meta, base, tensors) -> ModelConfig fields beyond those every GGUF file gives (loading/gguf_config.py):
    # meta(key, default) reads the file's `{arch}.{key}` (`tokenizer.*` and `general.*` keys whole), base holds the
    # fields read so far, tensors maps each tensor's name to its GGUF shape (reversed: columns first).
    # ValueError: a file it cannot run.
    gguf_fields: Callable[..., dict[str, Any]] | None = None
    # llama.cpp tensor name -> HF module where they differ from the shared decoder's (loading/gguf_loader.py): a
    # whole name (token_embd), a `blk.N.` one without the prefix (ffn_norm), or one with its suffix
    # (ffn_gate_inp.scale: a bare HF tensor); `{}` in the HF name: a stack, one HF tensor per entry (Gemma 3n's
    # AltUp). A family with its own gguf_layer_prefix (the encoders) is named by these alone.
    gguf_tensors: dict[str, str] = field(default_factory=dict)
    gguf_layer_prefix: str = "model.layers."  # the HF prefix of `blk.N.` tensors
    gguf_permuted_qk: bool = False  # q/k rows interleaved by convert_hf_to_gguf (LlamaModel.permute): undone at load
    # (config, release) -> a file's own renamer where names and values differ more than gguf_tensors says (the
    # hybrids: models/hybrid_gguf.py): .weights(gguf_name, weight) -> {HF name: weight}, .report(source) at the end
    gguf_weights: Callable[..., Any] | None = None
    chat_template: str | None = None  # its one chat format, for GGUF files converted without a template


_FAMILIES: dict[str, Family] = {}
_loaded = False


def register(*families: Family) -> None:
    for family in families:
        _FAMILIES[family.architecture] = family


def _load() -> None:
    global _loaded
    if not _loaded:
        importlib.import_module("conveyor.models.families")  # each module registers itself as it is imported
        _loaded = True


def get(architecture: str) -> Family | None:
    _load()
    return _FAMILIES.get(architecture)


def for_gguf(arch: str) -> Family | None:
    """The family a GGUF file of llama.cpp's `general.architecture` `arch` loads as (None: none)."""
    _load()
    return next((f for f in _FAMILIES.values() if arch in f.gguf_architectures), None)


def gguf_architectures(hybrid_only: bool = False) -> tuple[str, ...]:
    """Every GGUF `general.architecture` some family (a hybrid one) loads, in registration order."""
    _load()
    return tuple(dict.fromkeys(arch for f in _FAMILIES.values() if f.hybrid or not hybrid_only
                               for arch in f.gguf_architectures))


def gguf_not_yet(arch: str) -> str | None:
    """What a GGUF `general.architecture` that no family loads yet is (None: not one we know)."""
    _load()
    return importlib.import_module("conveyor.models.families").GGUF_NOT_YET.get(arch)


def gguf_layer_types(pattern: Any, num_layers: int, default: int, global_first: bool = False) -> tuple[str, ...]:
    """llama.cpp's `attention.sliding_window_pattern` as HF layer types: a bool per layer (True: sliding), or every
    n-th layer global: the last of each n (Gemma's), or with `global_first` the first (ModernBERT's; 0: none)."""
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    elif global_first:
        n = default if pattern is None else int(pattern)
        sliding = [n == 0 or i % n != 0 for i in range(num_layers)]
    else:
        n = int(pattern or default)
        sliding = [(i + 1) % n != 0 for i in range(num_layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def architectures() -> tuple[str, ...]:
    """Every registered model_type, in registration order."""
    _load()
    return tuple(_FAMILIES)


def multimodal_text_types() -> dict[str, str]:
    """Multimodal model_type -> the text model's type (the vision tower is not run)."""
    _load()
    return {**_MULTIMODAL_TEXT, **{f.multimodal_type: f.architecture for f in _FAMILIES.values() if f.multimodal_type}}


# Multimodal model_types whose text model is a family that already names another (Idefics3 / SmolVLM run Llama)
_MULTIMODAL_TEXT: dict[str, str] = {}


def register_multimodal_text(multimodal_type: str, architecture: str) -> None:
    _MULTIMODAL_TEXT[multimodal_type] = architecture


def is_hybrid(architecture: str) -> bool:
    family = get(architecture)
    return family is not None and family.hybrid


def expert_names(architecture: str) -> Any:
    """The family's config.ExpertNames (KeyError for a family without experts: a caller's bug)."""
    family = get(architecture)
    if family is None or family.expert_names is None:
        raise KeyError(f"{architecture!r} has no expert names")
    return family.expert_names


def model_class(architecture: str) -> type | None:
    """The class that runs `architecture`, or None for one no family registers."""
    family = get(architecture)
    if family is None:
        return None
    module, name = family.model_class.split(":")
    return getattr(importlib.import_module(module), name)
