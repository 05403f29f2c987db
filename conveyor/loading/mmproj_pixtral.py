"""llama.cpp's `pixtral` projector GGUF (convert_hf_to_gguf.py --mmproj of a Mistral3ForConditionalGeneration or
Pixtral 12B's LlavaForConditionalGeneration: conversion/llava.py's LlavaVisionModel) as the VisionCheckpoint
multimodal/pixtral.py loads.

The converter permutes q / k rows for llama.cpp's interleaved rotary (LlamaModel.permute); undone here. It also
copies the text model's [IMG_BREAK] embedding row (v.token_embd.img_break) for its own graph: unused, the text
model here embeds that token itself. clip.cpp resizes to the longest edge clip.vision.image_size, bicubic, with
rope theta 10000: the HF processor's and tower's settings below.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from conveyor.loading.checkpoint import LoadError
from conveyor.loading.mmproj_names import TensorNames, rename_tensors

TOWER, PROJECTOR = "vision_tower.", "multi_modal_projector."
_LAYER = {"ln1": "attention_norm", "ln2": "ffn_norm", "attn_q": "attention.q_proj", "attn_k": "attention.k_proj",
          "attn_v": "attention.v_proj", "attn_out": "attention.o_proj", "ffn_gate": "feed_forward.gate_proj",
          "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj"}
_NAMES = TensorNames({"v.patch_embd": TOWER + "patch_conv", "v.pre_ln": TOWER + "ln_pre",
                      "mm.input_norm": PROJECTOR + "norm", "mm.patch_merger": PROJECTOR + "patch_merger.merging_layer",
                      "mm.1": PROJECTOR + "linear_1", "mm.2": PROJECTOR + "linear_2"},
                     TOWER + "transformer.layers.{}", _LAYER, unused=frozenset({"v.token_embd.img_break"}))
_PERMUTED = (".attention.q_proj.", ".attention.k_proj.")  # llama.cpp's interleaved rotary rows (attn_q, attn_k)


def pixtral_checkpoint(meta: Callable[..., Any], tensors: dict[str, torch.Tensor], tokenizer: Any,
                       path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config, processor config, HF-named weights) from the file's metadata and its fp32 tensors (GGUF names);
    the config's model_type is mistral3, or llava for a projector without a patch merger (Pixtral 12B)."""
    merger = "mm.patch_merger.weight" in tensors  # Mistral 3's; Pixtral 12B's Llava projector has none
    image = tokenizer.token_to_id("[IMG]")
    for token in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"):
        if tokenizer.token_to_id(token) is None:
            raise LoadError(f"{path}: the text model's vocabulary has no {token} (not a Mistral 3 vision model?)")
    heads = int(meta("clip.vision.attention.head_count"))
    silu = bool(meta("clip.use_silu", False))
    eps = float(meta("clip.vision.attention.layer_norm_epsilon", 1e-5))
    config = {"model_type": "mistral3" if merger else "llava", "image_token_index": image,
              "spatial_merge_size": int(meta("clip.vision.spatial_merge_size", 1)),
              "multimodal_projector_bias": "mm.1.bias" in tensors, "projector_hidden_act": "gelu",
              "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
              # clip.cpp's projector norm takes the tower's eps (HF: the text model's rms_norm_eps; both 1e-5)
              "text_config": {"hidden_size": int(meta("clip.vision.projection_dim")), "rms_norm_eps": eps},
              "vision_config": {"hidden_size": int(meta("clip.vision.embedding_length")),
                                "intermediate_size": int(meta("clip.vision.feed_forward_length")),
                                "num_hidden_layers": int(meta("clip.vision.block_count")),
                                "num_attention_heads": heads, "patch_size": int(meta("clip.vision.patch_size")),
                                "hidden_act": "silu" if silu else "gelu", "rope_theta": 10_000.0}}
    processor = {"size": {"longest_edge": int(meta("clip.vision.image_size"))}, "resample": 3,
                 "rescale_factor": 1 / 255}
    for key in ("image_mean", "image_std"):  # else the processor's (CLIP's) defaults
        if meta(f"clip.vision.{key}") is not None:
            processor[key] = meta(f"clip.vision.{key}")
    weights = rename_tensors(tensors, _NAMES, path, "pixtral")
    for name in weights:
        if any(part in name for part in _PERMUTED):
            weights[name] = _unpermute(weights[name], heads)
    return config, processor, weights


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head, llama.cpp's x0 y0 x1 y1 ... rows back to HF's rotate-half [x0 .. | y0 ..]."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
