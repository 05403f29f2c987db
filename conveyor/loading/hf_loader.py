"""Load a Hugging Face model directory: config.json, *.safetensors and tokenizer files."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import replace
from typing import Any

import tokenizers
from safetensors.torch import load_file

from conveyor.loading.checkpoint import Checkpoint, LoadError, select_weights
from conveyor.loading.sentence_transformers import read_pooling
from conveyor.loading.tokenizer import SPECIAL_TOKEN_NAMES, Tokenizer, build_tokenizer
from conveyor.loading.tokenizer_cache import TOKENIZERS
from conveyor.models import family as families
from conveyor.models.config import ModelConfig, ModelConfigError
from conveyor.multimodal.vision import VisionCheckpoint, vision_model_types


def load_hf_dir(path: str) -> Checkpoint:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        hint = " (for a GGUF model pass the .gguf file itself)" if glob.glob(os.path.join(path, "*.gguf")) else ""
        raise LoadError(f"{path}: no config.json in the model directory{hint}")
    raw = read_json(config_path)
    try:
        config = ModelConfig.from_hf_dict(raw)
    except ModelConfigError as exc:
        raise LoadError(f"{config_path}: {exc}") from exc
    raw_weights = _read_safetensors(path)
    weights = rename_weights(config.architecture, text_model_weights(decoder_names(raw_weights)))
    tokenizer = load_hf_tokenizer(path, extra_eos_ids=config.eos_token_ids)
    config = replace(config, eos_token_ids=tuple(tokenizer.eos_token_ids))
    return Checkpoint(config=config, weights=select_weights(config, weights, path), tokenizer=tokenizer,
                      source=path, name=model_name(path), pooling=read_pooling(path),
                      mtp_weights={n: w for n, w in weights.items() if n.startswith("mtp.")},
                      vision=read_vision(path, raw, raw_weights))


def read_vision(path: str, raw: dict[str, Any], weights: dict[str, Any]) -> VisionCheckpoint | None:
    """A multimodal checkpoint's vision side (multimodal/vision.py builds its tower), None for a text model or a
    model_type without a vision family (its text model still loads)."""
    model_type = raw.get("model_type")
    if "vision_config" not in raw or model_type not in vision_model_types():
        return None
    processor = _optional_json(os.path.join(path, "preprocessor_config.json"))
    saved = _optional_json(os.path.join(path, "processor_config.json"))
    processor.update(saved.get("image_processor") or {})  # transformers 5 nests the image processor's settings
    processor.update({k: v for k, v in saved.items() if k != "image_processor"})
    return VisionCheckpoint(model_type, raw, processor, weights)


def decoder_names(weights: dict[str, Any]) -> dict[str, Any]:
    """A decoder saved without its head (transformers' Qwen3Model, as Qwen3-Embedding ships) names its tensors
    `layers.N...`, `embed_tokens...`: under the `model.` prefix the causal model's names have."""
    if "embed_tokens.weight" not in weights or "model.embed_tokens.weight" in weights:
        return weights
    return {f"model.{name}": tensor for name, tensor in weights.items()}


def model_name(path: str) -> str:
    """The folder name; for a Hub cache snapshot (models--org--name/snapshots/<hash>) the repo name."""
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return parts[-1]


def read_hf_dir_tokenizer(path: str) -> Tokenizer:
    """A model directory's tokenizer alone, as load_hf_dir reads it (the config's end tokens included)."""
    config = ModelConfig.from_hf_dict(read_json(os.path.join(path, "config.json")))
    return load_hf_tokenizer(path, extra_eos_ids=config.eos_token_ids)


# What load_hf_tokenizer reads: a change to any of them is a new tokenizer (loading/tokenizer_cache.py).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


def load_hf_tokenizer(path: str, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
    """tokenizer.json plus the special tokens and chat template from the files saved beside it."""
    return TOKENIZERS.get_or_build([os.path.join(path, name) for name in TOKENIZER_FILES],
                                   lambda: _read_hf_tokenizer(path, extra_eos_ids), extra=tuple(extra_eos_ids))


def _read_hf_tokenizer(path: str, extra_eos_ids: tuple[int, ...]) -> Tokenizer:
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        raise LoadError(f"{path}: no tokenizer.json in the model directory (only fast tokenizers are supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(tokenizer_path)
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise LoadError(f"{tokenizer_path}: cannot parse tokenizer ({exc})") from exc
    settings = _optional_json(os.path.join(path, "special_tokens_map.json"))
    settings.update(_optional_json(os.path.join(path, "tokenizer_config.json")))
    special = {name: _token_text(settings.get(name)) for name in SPECIAL_TOKEN_NAMES}
    generation = _optional_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
    generation_eos = generation if isinstance(generation, list) else [generation] if generation is not None else []
    # Like transformers, tokenizer.json's post-processor decides BOS/EOS; the add_*_token flags only fill a gap.
    flags = {"add_bos": settings.get("add_bos_token"), "add_eos": settings.get("add_eos_token")}
    return build_tokenizer(backend, special, _chat_template(path, settings),
                           extra_eos_ids=[*extra_eos_ids, *generation_eos],
                           **(flags if backend.post_processor is None else {}))


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise LoadError(f"{path}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise LoadError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def text_model_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text model under text-only names (model.language_model.* -> model.*; Llama 4's
    language_model.model.* and language_model.lm_head.* -> model.*, lm_head.*); select_weights then drops the
    rest (the vision tower model.visual.* or vision_model.*; the MTP head mtp.* goes to Checkpoint.mtp_weights)."""
    def text_name(name: str) -> str:
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        if name.startswith("model.text_model."):  # Idefics3 / SmolVLM
            return "model." + name[len("model.text_model."):]
        return name[len("language_model."):] if name.startswith("language_model.") else name

    return {text_name(name): tensor for name, tensor in weights.items()}


def rename_weights(architecture: str, weights: dict[str, Any]) -> dict[str, Any]:
    """A family's tensor names as the shared decoder's (its Family's weight_renames: Hunyuan's query_layernorm is
    q_norm, ...)."""
    family = families.get(architecture)
    renames = family.weight_renames if family is not None else None
    if not renames:
        return weights
    out = {}
    for name, tensor in weights.items():
        old = next((part for part in renames if part in name), None)  # one rename per name: GLM-4's swap two
        out[name.replace(old, renames[old]) if old else name] = tensor
    return out


def _optional_json(path: str) -> dict[str, Any]:
    return read_json(path) if os.path.isfile(path) else {}


def _read_safetensors(path: str) -> dict[str, Any]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        legacy = " (pytorch_model.bin is not supported)" if glob.glob(os.path.join(path, "*.bin")) else ""
        raise LoadError(f"{path}: no *.safetensors weight files in the model directory{legacy}")
    weights = {}
    for file in files:
        try:
            weights.update(load_file(file, device="cpu"))
        except Exception as exc:  # SafetensorError and OSError both mean the file is unusable
            raise LoadError(f"{file}: cannot read safetensors ({exc})") from exc
    return weights


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a token as a string or as an AddedToken dict {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(path: str, settings: dict[str, Any]) -> str | None:
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):  # newer transformers saves the template in its own file
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
