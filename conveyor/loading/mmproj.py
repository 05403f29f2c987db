"""llama.cpp's vision projector GGUF (`--mmproj`, convert_hf_to_gguf.py --mmproj) as a VisionCheckpoint.

The file's metadata becomes the Hugging Face config the vision family reads, and its tensors get back their HF names
(and values), so one family module loads either source: one loading/mmproj_*.py per projector type's names.
"""

from __future__ import annotations

from typing import Any, Callable

import gguf
import numpy as np
import torch

from conveyor.loading.checkpoint import LoadError
from conveyor.loading.gguf_config import field_value
from conveyor.loading.mmproj_lfm2 import lfm2_checkpoint
from conveyor.loading.mmproj_pixtral import pixtral_checkpoint
from conveyor.loading.mmproj_qwen3vl import qwen3vl_checkpoint
from conveyor.loading.mmproj_siglip import gemma3_checkpoint, idefics3_checkpoint
from conveyor.models import family as families
from conveyor.multimodal.vision import VisionCheckpoint

# Text GGUFs a projector also feeds: llama.cpp converts Mistral Small 3.1 / 3.2's and Pixtral 12B's text as llama
_ALSO_FEEDS = {"mistral3": ("llama", "mistral"), "llava": ("llama", "mistral")}


def read_mmproj(path: str, tokenizer: Any, text_config: Any = None) -> VisionCheckpoint:
    """The vision side of `path`; LoadError for a file that is not a projector we can run, or (given the text
    model's ModelConfig) not one for that text model."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise LoadError(f"{path}: cannot read the mmproj GGUF ({exc})") from exc
    meta: Callable[..., Any] = lambda key, default=None: field_value(reader, key, default)  # noqa: E731
    kind = meta("clip.vision.projector_type") or meta("clip.projector_type")
    if kind not in ("gemma3", "idefics3", "pixtral", "qwen3vl_merger", "lfm2"):
        raise LoadError(f"{path}: mmproj projector type {kind!r} is not supported (supported: gemma3, idefics3, "
                        "pixtral, qwen3vl_merger, lfm2)")
    tensors = {t.name: _tensor(t) for t in reader.tensors}
    if kind == "qwen3vl_merger":  # Qwen3-VL, Qwen3.5: its own tensor names (loading/mmproj_qwen3vl.py)
        config, processor, weights = qwen3vl_checkpoint(meta, tensors, tokenizer, path,
                                                        _qwen_vl_type(meta, text_config))
    elif kind == "lfm2":  # LFM2-VL: its own tensor names (loading/mmproj_lfm2.py)
        config, processor, weights = lfm2_checkpoint(meta, tensors, tokenizer, path)
    elif kind == "pixtral":  # Mistral 3 / Pixtral 12B: its own tensor names (loading/mmproj_pixtral.py)
        config, processor, weights = pixtral_checkpoint(meta, tensors, tokenizer, path)
    elif kind == "idefics3":  # Idefics3 / SmolVLM: SigLIP's names (loading/mmproj_siglip.py)
        config, processor, weights = idefics3_checkpoint(meta, tensors, tokenizer, path)
    else:  # Gemma 3: SigLIP's names (loading/mmproj_siglip.py)
        config, processor, weights = gemma3_checkpoint(meta, tensors, tokenizer, path)
    vision = VisionCheckpoint(config["model_type"], config, processor, weights)
    if text_config is not None:
        _check_pairing(vision, text_config, path)
    return vision


def _qwen_vl_type(meta: Callable[..., Any], text_config: Any) -> str:
    """The multimodal model_type a qwen3vl_merger projector loads as: its text model's (Qwen3-VL and Qwen3.5, dense
    or MoE); without one, Qwen3-VL where it has DeepStack layers."""
    if text_config is None:
        return "qwen3_vl" if any(meta("clip.vision.is_deepstack_layers", []) or []) else "qwen3_5"
    types = {"qwen3_vl_text": "qwen3_vl", "qwen3_vl_moe_text": "qwen3_vl_moe", "qwen3_5_moe_text": "qwen3_5_moe"}
    return types.get(text_config.architecture, "qwen3_5")


def _check_pairing(vision: VisionCheckpoint, text_config: Any, path: str) -> None:
    """The projector must feed this text model: its family's multimodal type, its width, its DeepStack levels."""
    family = families.get(text_config.architecture)
    aliased = families.multimodal_text_types().get(vision.model_type) == text_config.architecture  # Idefics3: llama
    aliased = aliased or text_config.architecture in _ALSO_FEEDS.get(vision.model_type, ())
    if family is None or (family.multimodal_type != vision.model_type and not aliased):
        raise LoadError(f"{path}: a {vision.model_type} vision projector cannot feed a {text_config.architecture} "
                        "text model")
    width = vision.config["text_config"]["hidden_size"]
    if width != text_config.hidden_size:
        raise LoadError(f"{path}: the projector writes {width}-wide embeddings, the text model is "
                        f"{text_config.hidden_size} wide")
    levels = len(vision.config.get("vision_config", {}).get("deepstack_visual_indexes") or ())
    expected = text_config.num_deepstack_levels  # None: not stated (the text model takes the levels that come)
    if expected is not None and levels != expected:  # else wrong output, no error: levels missing or extra
        raise LoadError(f"{path}: the mmproj has {levels} DeepStack levels, the {text_config.architecture} text model "
                        f"expects {expected} (its n_deepstack_layers)")


def _tensor(tensor: Any) -> torch.Tensor:
    """fp32 values in the HF shape (GGUF lists dims fastest first; the reader's array is already row-major)."""
    data = np.asarray(tensor.data)
    if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = gguf.quants.dequantize(data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)  # a copy: the file is mapped read-only
