"""llama.cpp's `lfm2` projector GGUF (convert_hf_to_gguf.py --mmproj of an Lfm2VlForConditionalGeneration:
conversion/lfm2.py's LFM2VLModel) as the VisionCheckpoint multimodal/lfm2_vl.py loads.

The converter stores SigLIP2's linear patch embedding as a conv kernel (out, 3, p, p) (flattened back here in the
(y, x, channel) order of the processor's patches), writes a dummy image_size (256) and no processor settings:
clip.cpp's LFM2 limits (64..256 tokens per image) are the HF processor's defaults, which stand in (tile 512 px,
2..10 tiles + thumbnail), with the file's patch size, scale factor, mean and std.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from conveyor.loading.checkpoint import LoadError
from conveyor.loading.mmproj_names import TensorNames, rename_tensors
from conveyor.loading.mmproj_siglip import SIGLIP_LAYER_NAMES

TOWER = "model.vision_tower.vision_model."
PROJECTOR = "model.multi_modal_projector."
_NAMES = TensorNames({"v.patch_embd": TOWER + "embeddings.patch_embedding",
                      "v.position_embd": TOWER + "embeddings.position_embedding", "v.post_ln": TOWER + "post_layernorm",
                      "mm.input_norm": PROJECTOR + "layer_norm", "mm.1": PROJECTOR + "linear_1",
                      "mm.2": PROJECTOR + "linear_2"}, TOWER + "encoder.layers.{}", SIGLIP_LAYER_NAMES)


def lfm2_checkpoint(meta: Callable[..., Any], tensors: dict[str, torch.Tensor], tokenizer: Any,
                    path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config, processor config, HF-named weights) from the file's metadata and its fp32 tensors (GGUF names)."""
    image = tokenizer.token_to_id("<image>")
    if image is None:
        raise LoadError(f"{path}: the text model's vocabulary has no <image> (not an LFM2-VL model?)")
    weights = rename_tensors(tensors, _NAMES, path, "lfm2")
    kernel = weights.get(TOWER + "embeddings.patch_embedding.weight")
    if kernel is None or kernel.dim() != 4:
        raise LoadError(f"{path}: the projector has no conv-shaped patch embedding (v.patch_embd.weight)")
    weights[TOWER + "embeddings.patch_embedding.weight"] = kernel.permute(0, 2, 3, 1).reshape(kernel.shape[0], -1)
    patch, factor = int(meta("clip.vision.patch_size")), int(meta("clip.vision.projector.scale_factor", 2))
    linear_1 = weights.get(PROJECTOR + "linear_1.weight")
    if linear_1 is None or PROJECTOR + "linear_2.weight" not in weights:
        raise LoadError(f"{path}: the projector has no mm.1 / mm.2")
    vision = {"hidden_size": int(meta("clip.vision.embedding_length")),
              "intermediate_size": int(meta("clip.vision.feed_forward_length")),
              "num_hidden_layers": int(meta("clip.vision.block_count")),
              "num_attention_heads": int(meta("clip.vision.attention.head_count")),
              "layer_norm_eps": float(meta("clip.vision.attention.layer_norm_epsilon", 1e-6)), "patch_size": patch,
              "num_patches": int(weights[TOWER + "embeddings.position_embedding.weight"].shape[0]), "num_channels": 3}
    config = {"model_type": "lfm2_vl", "image_token_id": image, "vision_config": vision, "downsample_factor": factor,
              "projector_hidden_size": int(linear_1.shape[0]),
              "projector_bias": PROJECTOR + "linear_1.bias" in weights,
              "projector_use_layernorm": PROJECTOR + "layer_norm.weight" in weights,
              "text_config": {"hidden_size": int(meta("clip.vision.projection_dim"))}}
    processor = {"encoder_patch_size": patch, "downsample_factor": factor,
                 "image_mean": list(meta("clip.vision.image_mean", [0.5] * 3)),
                 "image_std": list(meta("clip.vision.image_std", [0.5] * 3))}
    return config, processor, weights
