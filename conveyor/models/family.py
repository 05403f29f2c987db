"""Model families: what each architecture (a Hugging Face `model_type`) changes, declared by its own module.

A family module (models/gemma.py, models/qwen3_5.py, ...) ends with `register(Family(...))`: its config fields,
its tensor names where they differ from the shared decoder's, and the model class that runs it. The central
config, the model registry and the loaders look families up here and name none of them; the first lookup
imports every family module (models/families.py lists them), so adding a family is one new file and one line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    architecture: str  # the HF model_type (GGUF architectures map onto these in loading/gguf_config.py)
    model_class: str  # "module:Class" that runs it, imported when a model is built
    hf_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # raw HF config -> ModelConfig fields
    weight_renames: dict[str, str] = field(default_factory=dict)  # checkpoint name part -> the decoder's
    weight_names: Callable[[Any], list[str]] | None = None  # its own tensor list (layers unlike the decoder's)
    optional_weights: tuple[str, ...] = ()  # kept where a checkpoint has them, never required (an encoder's pooler)
    hybrid: bool = False  # pre-norm residual steps of attention / recurrent / channel mixers (models/hybrid.py)
    multimodal_type: str | None = None  # the model_type of the multimodal directory whose text part this is
    expert_names: Any = None  # config.ExpertNames: where its checkpoints keep the sparse MLP (MoE families)


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


def architectures() -> tuple[str, ...]:
    """Every registered model_type, in registration order."""
    _load()
    return tuple(_FAMILIES)


def multimodal_text_types() -> dict[str, str]:
    """Multimodal model_type -> the text model's type (the vision tower is not run)."""
    _load()
    return {f.multimodal_type: f.architecture for f in _FAMILIES.values() if f.multimodal_type}


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
