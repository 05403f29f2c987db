"""llama.cpp's `qwen3vl_merger` projector GGUF (convert_hf_to_gguf.py --mmproj of a Qwen3VLForConditionalGeneration
or Qwen3_5ForConditionalGeneration: conversion/qwen3vl.py's Qwen3VLVisionModel) as the VisionCheckpoint
multimodal/qwen3_vl.py loads.

The converter splits the Conv3d patch kernel into its two frames (v.patch_embd.weight and .weight.1: stacked back
here) and writes no temporal patch size (it requires 2), no rope theta (clip.cpp: 10000) and no pixel limits:
clip.cpp's Qwen-VL limits (8 to 4096 merged tokens per image) stand in for the HF processor's. Its
layer_norm_epsilon is the text model's RMSNorm epsilon; the tower's LayerNorms use transformers' hard-coded 1e-6.
Qwen3-VL's DeepStack mergers are `v.deepstack.{block}.{norm,fc1,fc2}`, named by the tower block they read, with
clip.vision.is_deepstack_layers flagging those blocks; they come back as deepstack_merger_list.{k} in block order.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from conveyor.loading.checkpoint import LoadError
from conveyor.loading.mmproj_names import TensorNames, rename_tensors

TOWER = "model.visual."
_LAYER = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ffn_up": "mlp.linear_fc1",
          "ffn_down": "mlp.linear_fc2"}
_STEMS = {"v.patch_embd": TOWER + "patch_embed.proj", "v.position_embd": TOWER + "pos_embed",
          "v.post_ln": TOWER + "merger.norm", "mm.0": TOWER + "merger.linear_fc1", "mm.2": TOWER + "merger.linear_fc2"}
_DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
MIN_TOKENS, MAX_TOKENS = 8, 4096  # clip.cpp's set_limit_image_tokens for Qwen-VL projectors


def qwen3vl_checkpoint(meta: Callable[..., Any], tensors: dict[str, torch.Tensor], tokenizer: Any, path: str,
                       model_type: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config, processor config, HF-named weights) from the file's metadata and its fp32 tensors (GGUF names)."""
    deepstack = [i for i, flag in enumerate(meta("clip.vision.is_deepstack_layers", []) or []) if flag]
    if deepstack and model_type not in ("qwen3_vl", "qwen3_vl_moe"):
        raise LoadError(f"{path}: a Qwen3-VL projector (DeepStack layers {deepstack}) cannot feed a {model_type} text "
                        "model")
    image = tokenizer.token_to_id("<|image_pad|>")
    if image is None:
        raise LoadError(f"{path}: the text model's vocabulary has no <|image_pad|> (not a Qwen vision model?)")
    weights: dict[str, torch.Tensor] = {}
    frames = [tensors.pop("v.patch_embd.weight", None), tensors.pop("v.patch_embd.weight.1", None)]
    if frames[0] is None or frames[1] is None:
        raise LoadError(f"{path}: the projector has no two-frame patch embedding (v.patch_embd.weight, .weight.1)")
    weights[TOWER + "patch_embed.proj.weight"] = torch.stack(frames, dim=2)  # (out, C, T=2, P, P)
    weights.update(rename_tensors(tensors, _names(deepstack), path, "qwen3vl_merger"))
    patch, merge = int(meta("clip.vision.patch_size")), int(meta("clip.vision.spatial_merge_size", 2))
    width = int(meta("clip.vision.projection_dim"))
    positions = weights[TOWER + "pos_embed.weight"].shape[0]
    if math.isqrt(positions) ** 2 != positions:
        raise LoadError(f"{path}: {positions} position embeddings are not a square grid")
    vision = {"depth": int(meta("clip.vision.block_count")), "hidden_size": int(meta("clip.vision.embedding_length")),
              "intermediate_size": int(meta("clip.vision.feed_forward_length")),
              "num_heads": int(meta("clip.vision.attention.head_count")), "in_channels": 3, "patch_size": patch,
              "spatial_merge_size": merge, "temporal_patch_size": 2, "out_hidden_size": width,
              "num_position_embeddings": positions, "hidden_act": "gelu_pytorch_tanh",
              "deepstack_visual_indexes": deepstack}
    config = {"model_type": model_type, "image_token_id": image, "vision_config": vision,
              "vision_start_token_id": tokenizer.token_to_id("<|vision_start|>"),
              "vision_end_token_id": tokenizer.token_to_id("<|vision_end|>"), "text_config": {"hidden_size": width}}
    area = (patch * merge) ** 2
    processor = {"size": {"shortest_edge": MIN_TOKENS * area, "longest_edge": MAX_TOKENS * area},
                 "patch_size": patch, "merge_size": merge, "temporal_patch_size": 2,
                 "image_mean": list(meta("clip.vision.image_mean", [0.5] * 3)),
                 "image_std": list(meta("clip.vision.image_std", [0.5] * 3))}
    return config, processor, weights


def _names(deepstack: list[int]) -> TensorNames:
    """The file's names: a DeepStack merger's are those of the block it reads, flagged in `deepstack` (merger k
    reads the k-th flagged block); an unflagged block's merger tensors are unknown."""
    mergers = {f"v.deepstack.{block}.{part}": f"{TOWER}deepstack_merger_list.{k}.{theirs}"
               for k, block in enumerate(deepstack) for part, theirs in _DEEPSTACK.items()}
    return TensorNames({**_STEMS, **mergers}, TOWER + "blocks.{}", _LAYER)
