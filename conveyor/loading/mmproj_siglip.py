"""llama.cpp's SigLIP projector GGUFs, `gemma3` and `idefics3` (convert_hf_to_gguf.py --mmproj of Gemma 3 and
Idefics3 / SmolVLM: Gemma3VisionModel, SmolVLMModel), as the VisionCheckpoints multimodal/gemma3.py and
idefics3.py load: the metadata as the Hugging Face config, the tensors under their HF names (and values: the
converter stored Gemma's soft_emb_norm as 1 + w).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from conveyor.loading.checkpoint import LoadError
from conveyor.loading.mmproj_names import TensorNames, rename_tensors

TOWER = "vision_tower.vision_model."
# llama.cpp's names inside `v.blk.N.` -> SigLIP's inside `encoder.layers.N.` (LFM2-VL's SigLIP2 layers too)
SIGLIP_LAYER_NAMES = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
                      "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
                      "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_TOWER_STEMS = {"v.patch_embd": TOWER + "embeddings.patch_embedding",
                "v.position_embd": TOWER + "embeddings.position_embedding", "v.post_ln": TOWER + "post_layernorm"}
_GEMMA3 = TensorNames({**_TOWER_STEMS, "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
                       "mm.input_projection": "multi_modal_projector.mm_input_projection"},
                      TOWER + "encoder.layers.{}", SIGLIP_LAYER_NAMES)
_IDEFICS3 = TensorNames({**_TOWER_STEMS, "mm.model.fc": "connector.modality_projection.proj"},
                        TOWER + "encoder.layers.{}", SIGLIP_LAYER_NAMES)


def gemma3_checkpoint(meta: Callable[..., Any], tensors: dict[str, torch.Tensor], tokenizer: Any,
                      path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config, processor config, HF-named weights) from the file's metadata and its fp32 tensors (GGUF names)."""
    weights = rename_tensors(tensors, _GEMMA3, path, "gemma3")
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    if norm not in weights:
        raise LoadError(f"{path}: the gemma3 projector has no mm.soft_emb_norm.weight")
    weights[norm] = weights[norm] - 1.0  # stored as Gemma's 1 + w
    if "multi_modal_projector.mm_input_projection.weight" in weights:
        weights["multi_modal_projector.mm_input_projection_weight"] = weights.pop(
            "multi_modal_projector.mm_input_projection.weight")
    return _gemma3_config(meta, tokenizer, path), _processor(meta), weights


def idefics3_checkpoint(meta: Callable[..., Any], tensors: dict[str, torch.Tensor], tokenizer: Any,
                        path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config, processor config, HF-named weights): SigLIP's names, the connector's `mm.model.fc`."""
    config, processor = _idefics3_config(meta, tokenizer, path)
    return config, processor, rename_tensors(tensors, _IDEFICS3, path, "idefics3")


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
