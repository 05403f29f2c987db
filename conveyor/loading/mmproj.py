"""llama.cpp's vision projector GGUF (`--mmproj`, convert_hf_to_gguf.py --mmproj) as a VisionCheckpoint.

The file's metadata becomes the Hugging Face config the vision family reads, and its tensors get back their HF names
(and values: the converter stored Gemma's soft_emb_norm as 1 + w), so one family module loads either source.
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
from conveyor.models import family as families
from conveyor.multimodal.vision import VisionCheckpoint

TOWER = "vision_tower.vision_model."
# llama.cpp's names inside `v.blk.N.` -> SigLIP's inside `encoder.layers.N.`
_LAYER_NAMES = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1",
                "ffn_down": "mlp.fc2"}
_NAMES = {"v.patch_embd": TOWER + "embeddings.patch_embedding", "v.position_embd": TOWER + "embeddings.position_embedding",
          "v.post_ln": TOWER + "post_layernorm", "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
          "mm.input_projection": "multi_modal_projector.mm_input_projection",
          "mm.model.fc": "connector.modality_projection.proj"}  # Idefics3's


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
    elif kind == "idefics3":  # SigLIP's names, as Gemma 3's
        weights = {_hf_name(name): tensor for name, tensor in tensors.items()}
        config, processor = _idefics3_config(meta, tokenizer, path)
    else:
        config, processor, weights = _gemma3_checkpoint(meta, tensors, tokenizer, path)
    vision = VisionCheckpoint(config["model_type"], config, processor, weights)
    if text_config is not None:
        _check_pairing(vision, text_config, path)
    return vision


def _gemma3_checkpoint(meta: Callable[..., Any], tensors: dict[str, torch.Tensor], tokenizer: Any,
                       path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    weights = {_hf_name(name): tensor for name, tensor in tensors.items()}
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    if norm not in weights:
        raise LoadError(f"{path}: the gemma3 projector has no mm.soft_emb_norm.weight")
    weights[norm] = weights[norm] - 1.0  # stored as Gemma's 1 + w
    if "multi_modal_projector.mm_input_projection.weight" in weights:
        weights["multi_modal_projector.mm_input_projection_weight"] = weights.pop(
            "multi_modal_projector.mm_input_projection.weight")
    return _gemma3_config(meta, tokenizer, path), _processor(meta), weights


def _qwen_vl_type(meta: Callable[..., Any], text_config: Any) -> str:
    """The multimodal model_type a qwen3vl_merger projector loads as: its text model's (Qwen3-VL and Qwen3.5, dense
    or MoE); without one, Qwen3-VL where it has DeepStack layers."""
    if text_config is None:
        return "qwen3_vl" if any(meta("clip.vision.is_deepstack_layers", []) or []) else "qwen3_5"
    types = {"qwen3_vl_text": "qwen3_vl", "qwen3_vl_moe_text": "qwen3_vl_moe", "qwen3_5_moe_text": "qwen3_5_moe"}
    return types.get(text_config.architecture, "qwen3_5")


def _check_pairing(vision: VisionCheckpoint, text_config: Any, path: str) -> None:
    """The projector must feed this text model: its family's multimodal type, its width."""
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


def _gemma3_config(meta: Callable[..., Any], tokenizer: Any, path: str) -> dict[str, Any]:
    image_size, patch = int(meta("clip.vision.image_size")), int(meta("clip.vision.patch_size"))
    per_side = image_size // patch // int(meta("clip.vision.projector.scale_factor", 4))
    ids = {}
    for key, token in (("boi_token_index", "<start_of_image>"), ("eoi_token_index", "<end_of_image>")):
        ids[key] = tokenizer.token_to_id(token)
        if ids[key] is None:
            raise LoadError(f"{path}: the text model's vocabulary has no {token} (not a Gemma 3 vision model?)")
    # llama.cpp's converter cuts the vocabulary at tokenizer.model's 262144 pieces, so <image_soft_token> (262144)
    # is gone; its rows take the tower's output anyway: pad (0) stands in, as transformers' lookup does for it.
    soft = tokenizer.token_to_id("<image_soft_token>")
    ids["image_token_index"] = soft if soft is not None else 0
    return {"model_type": "gemma3", "mm_tokens_per_image": per_side * per_side, **ids,
            "text_config": {"hidden_size": int(meta("clip.vision.projection_dim"))},
            "vision_config": {"hidden_size": int(meta("clip.vision.embedding_length")),
                              "intermediate_size": int(meta("clip.vision.feed_forward_length")),
                              "num_hidden_layers": int(meta("clip.vision.block_count")),
                              "num_attention_heads": int(meta("clip.vision.attention.head_count")),
                              "layer_norm_eps": float(meta("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                              "image_size": image_size, "patch_size": patch}}


def _idefics3_config(meta: Callable[..., Any], tokenizer: Any,
                     path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Idefics3 / SmolVLM (convert_hf_to_gguf.py's SmolVLMModel): the tower's shape, scale_factor, and the
    processor's longest edge (clip.vision.preproc_image_size); tiles are the tower's image_size."""
    image = tokenizer.token_to_id("<image>")
    if image is None:
        raise LoadError(f"{path}: the text model's vocabulary has no <image> (not an Idefics3 / SmolVLM model?)")
    image_size = int(meta("clip.vision.image_size"))
    config = {"model_type": "idefics3", "image_token_id": image,
              "scale_factor": int(meta("clip.vision.projector.scale_factor", 2)),
              "text_config": {"hidden_size": int(meta("clip.vision.projection_dim"))},
              "vision_config": {"hidden_size": int(meta("clip.vision.embedding_length")),
                                "intermediate_size": int(meta("clip.vision.feed_forward_length")),
                                "num_hidden_layers": int(meta("clip.vision.block_count")),
                                "num_attention_heads": int(meta("clip.vision.attention.head_count")),
                                "layer_norm_eps": float(meta("clip.vision.attention.layer_norm_epsilon", 1e-5)),
                                "image_size": image_size, "patch_size": int(meta("clip.vision.patch_size"))}}
    processor = {"size": {"longest_edge": int(meta("clip.vision.preproc_image_size", image_size))},
                 "max_image_size": {"longest_edge": image_size}, "do_image_splitting": True,
                 "image_mean": meta("clip.vision.image_mean", [0.5] * 3),
                 "image_std": meta("clip.vision.image_std", [0.5] * 3), "resample": 1, "rescale_factor": 1 / 255}
    return config, processor


def _processor(meta: Callable[..., Any]) -> dict[str, Any]:
    size = int(meta("clip.vision.image_size"))
    return {"size": {"height": size, "width": size}, "image_mean": meta("clip.vision.image_mean", [0.5] * 3),
            "image_std": meta("clip.vision.image_std", [0.5] * 3), "resample": 2, "rescale_factor": 1 / 255}


def _hf_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem.startswith("v.blk."):
        _, _, layer, part = stem.split(".", 3)
        if part in _LAYER_NAMES:
            return f"{TOWER}encoder.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return f"{_NAMES[stem]}.{kind}" if stem in _NAMES else name


def _tensor(tensor: Any) -> torch.Tensor:
    """fp32 values in the HF shape (GGUF lists dims fastest first; the reader's array is already row-major)."""
    data = np.asarray(tensor.data)
    if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = gguf.quants.dequantize(data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)  # a copy: the file is mapped read-only
