"""A model directory's sentence-transformers files -> how its vectors are made (models/pooling.py).

sentence-transformers saves an embedder as a pipeline in `modules.json`: the Transformer (the directory's
own model), then Pooling (`1_Pooling/config.json`), optional Dense layers (`2_Dense/`) and Normalize.
`config_sentence_transformers.json` names its prompts (Qwen3-Embedding's query instruction).
"""

from __future__ import annotations

import json
import os
from typing import Any

from safetensors.torch import load_file

from conveyor.loading.checkpoint import LoadError
from conveyor.models.pooling import DenseSpec, PoolingConfig, PoolingConfigError

# The Hub's files name modules `sentence_transformers.models.Dense`; sentence-transformers >= 5 saves each one's
# own module path (`sentence_transformers.base.modules.dense.Dense`): the class name decides.
_PACKAGE = "sentence_transformers."
# Pooling modes sentence-transformers writes (pooling_mode_<name>: true, or pooling_mode: <name>) -> ours.
_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean", "cls_token": "cls", "cls": "cls"}
_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}


def read_pooling(path: str) -> PoolingConfig | None:
    """The directory's pooling pipeline, or None when it has no modules.json (not a sentence-transformers model)."""
    modules_path = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _json(modules_path)
    if not isinstance(modules, list):
        raise LoadError(f"{modules_path}: expected a list of modules")
    pooling, normalize, dense = None, False, []
    for module in modules:
        kind = str(module.get("type", ""))
        kind = kind.rpartition(".")[2] if kind.startswith(_PACKAGE) else kind
        where = os.path.join(path, module.get("path") or "")
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _pooling_mode(os.path.join(where, "config.json"))
        elif kind == "Normalize":
            normalize = True
        elif kind == "Dense":
            dense.append(_dense(where))
        else:
            raise LoadError(f"{modules_path}: the sentence-transformers module {kind or module!r} is not supported "
                            f"(supported: Transformer, Pooling, Dense, Normalize)")
    if pooling is None:
        raise LoadError(f"{modules_path}: no Pooling module")
    settings = _json(os.path.join(path, "config_sentence_transformers.json"), required=False) or {}
    prompts = settings.get("prompts") or {}
    try:
        return PoolingConfig(pooling=pooling, normalize=normalize, dense=tuple(dense),
                             prompts={str(k): str(v) for k, v in prompts.items()},
                             default_prompt_name=settings.get("default_prompt_name"))
    except PoolingConfigError as exc:
        raise LoadError(f"{path}: {exc}") from exc


def _pooling_mode(config_path: str) -> str:
    config = _json(config_path)
    named = config.get("pooling_mode")
    modes = [named] if named else [key.removeprefix("pooling_mode_") for key, on in config.items()
                                   if key.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in _MODES:
        raise LoadError(f"{config_path}: pooling {modes or 'none'} is not supported (supported: one of lasttoken, "
                        f"mean_tokens, cls_token)")
    return _MODES[modes[0]]


def _dense(where: str) -> DenseSpec:
    config = _json(os.path.join(where, "config.json"))
    activation = _ACTIVATIONS.get(config.get("activation_function", "torch.nn.modules.linear.Identity"))
    if activation is None:
        raise LoadError(f"{where}: Dense activation {config.get('activation_function')!r} is not supported "
                        f"(supported: Identity, Tanh)")
    weights_path = os.path.join(where, "model.safetensors")
    if not os.path.isfile(weights_path):
        raise LoadError(f"{where}: no model.safetensors for the Dense layer (pytorch_model.bin is not supported)")
    tensors = load_file(weights_path)
    weight = tensors.get("linear.weight")
    if weight is None or tuple(weight.shape) != (config.get("out_features"), config.get("in_features")):
        raise LoadError(f"{weights_path}: expected linear.weight of shape (out_features, in_features)")
    return DenseSpec(weight, tensors.get("linear.bias") if config.get("bias", True) else None, activation)


def _json(path: str, required: bool = True) -> Any:
    if not os.path.isfile(path):
        if required:
            raise LoadError(f"{path}: missing (a sentence-transformers module's config)")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise LoadError(f"{path}: cannot read ({exc})") from None
