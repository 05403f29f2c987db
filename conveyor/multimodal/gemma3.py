"""Gemma 3's vision side: the processor (resize, rescale, normalize; `<start_of_image>` -> its token run), the
SigLIP tower and the projector (avg-pool to mm_tokens_per_image, (1 + w) RMSNorm, one matmul), as transformers'
Gemma3Processor / SiglipVisionModel / Gemma3MultiModalProjector compute them.

The tower runs one image per call (its output depends only on the image's pixels): SigLIP layers (siglip.py) with
torch's linears and norms, the attention and GELU through the engine's KernelBackend (dense_attention: the C++ kernel
where it runs AMX tiles; docs/vision.md "Tower speed").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from conveyor.kernels import KernelBackend
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.preprocess import HALF, PixelNormalizer, check_marker_count, resample_filter
from conveyor.multimodal.siglip import SiglipBuffers, SiglipLayer, siglip_layer_names
from conveyor.multimodal.tower_weights import find_prefix, load_renamed
from conveyor.multimodal.vision import ExpandedPrompt, ImageItem, VisionCheckpoint, VisionModel

# Where checkpoints keep the tower and projector: the Hub's layout (transformers 5 saves it too), then the in-memory
# one.
TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                  "model.vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# SiglipVisionConfig's defaults, where a config.json's vision_config leaves a field out
SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=224, patch_size=16, layer_norm_eps=1e-6, num_channels=3)


class Gemma3Processor:
    """`<start_of_image>` -> `\\n\\n<start_of_image>` + N x `<image_soft_token>` + `<end_of_image>\\n\\n`, at the
    token level. HF expands the text and tokenizes it, so a newline run next to the marker merges into one token
    ("\\n" + "\\n\\n" is "\\n\\n\\n" in Gemma's vocabulary): merged here the same way, where the vocabulary has it."""

    def __init__(self, raw: dict[str, Any], processor_config: dict[str, Any], tokenizer: Any) -> None:
        self.image_marker_id = int(raw.get("boi_token_index", raw.get("boi_token_id", 255_999)))
        self.eoi_id = int(raw.get("eoi_token_index", raw.get("eoi_token_id", 256_000)))
        self.soft_id = int(raw.get("image_token_index", raw.get("image_token_id", 262_144)))
        self.num_embeds = int(raw.get("mm_tokens_per_image", 256))
        self.image_marker = tokenizer.decode([self.image_marker_id], skip_special_tokens=False)
        self.tokenizer = tokenizer
        # Single tokens that spell a run of newlines: token -> its count (what a merge beside the marker joins).
        self.newline_count: dict[int, int] = {}
        for count in range(1, 9):
            ids = tokenizer.encode("\n" * count, add_special_tokens=False)
            if len(ids) == 1:
                self.newline_count[ids[0]] = count
        if 2 not in self.newline_count.values():
            raise ValueError("gemma3: the tokenizer has no single token for '\\n\\n'")
        vision = {**SIGLIP_DEFAULTS, **(raw.get("vision_config") or {})}
        size = processor_config.get("size") or {}
        self.image_size = int(size.get("height") or vision.get("image_size", 224))
        self.resample = resample_filter(processor_config, 2)  # bilinear
        self.normalize = PixelNormalizer.from_config(processor_config, HALF, HALF)
        if processor_config.get("do_pan_and_scan"):
            raise ValueError("gemma3: do_pan_and_scan is not supported")

    def pixels(self, image: ImageInput) -> torch.Tensor:
        """(3, S, S) float32, as Gemma3ImageProcessorPil: PIL resize, x * rescale in float64 -> float32, then
        (x - mean) / std in float32."""
        resized = image.image.resize((self.image_size, self.image_size), resample=self.resample)
        return torch.from_numpy(np.ascontiguousarray(self.normalize(resized)))

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence[ImageInput]) -> ExpandedPrompt:
        check_marker_count(prompt_token_ids, self.image_marker_id, self.image_marker, images)
        out: list[int] = []
        items: list[ImageItem] = []
        pending = iter(images)
        ids = list(prompt_token_ids)
        i = 0
        while i < len(ids):
            token = ids[i]
            if token != self.image_marker_id:
                out.append(token)
                i += 1
                continue
            image = next(pending)
            left = self.newline_count.get(out[-1], 0) if out else 0
            if left:
                out.pop()
                if items and items[-1].end > len(out):  # the previous image's closing "\n\n" joins this one's
                    items[-1] = replace(items[-1], num_tokens=items[-1].num_tokens - 1)
            right = self.newline_count.get(ids[i + 1], 0) if i + 1 < len(ids) else 0
            i += 2 if right else 1
            offset = len(out)
            head = self._newlines(left + 2)
            run = head + [self.image_marker_id] + [self.soft_id] * self.num_embeds + [self.eoi_id]
            run += self._newlines(right + 2)
            out += run
            items.append(ImageItem(image.content_hash, offset, len(run), ((len(head) + 1, self.num_embeds),),
                                   self.pixels(image), bidirectional=True))
        return ExpandedPrompt(out, items)

    def _newlines(self, count: int) -> list[int]:
        """The ids the tokenizer gives a run of `count` newlines (the marker's "\\n\\n" joined with its neighbour's)."""
        return self.tokenizer.encode("\n" * count, add_special_tokens=False)


class Gemma3VisionEncoder(nn.Module):
    """SigLIP (patch conv, learned positions, pre-LN layers, post_layernorm) + Gemma3MultiModalProjector."""

    def __init__(self, raw: dict[str, Any], ops: KernelBackend | None = None) -> None:
        super().__init__()
        vision = {**SIGLIP_DEFAULTS, **(raw.get("vision_config") or {})}
        hidden, eps = int(vision["hidden_size"]), float(vision.get("layer_norm_eps", 1e-6))
        self.patch = int(vision["patch_size"])
        self.patches_per_side = int(vision["image_size"]) // self.patch
        self.patch_embedding = nn.Conv2d(int(vision.get("num_channels", 3)), hidden, self.patch, self.patch)
        self.position_embedding = nn.Parameter(torch.zeros(self.patches_per_side ** 2, hidden))
        self.layers = nn.ModuleList(
            SiglipLayer(hidden, int(vision["intermediate_size"]), int(vision["num_attention_heads"]), eps, ops)
            for _ in range(int(vision["num_hidden_layers"])))
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)
        tokens_per_side = int(math.isqrt(int(raw.get("mm_tokens_per_image", 256))))
        self.pool = self.patches_per_side // tokens_per_side
        text_hidden = int(raw["text_config"]["hidden_size"])
        self.soft_emb_norm = nn.Parameter(torch.zeros(hidden))
        self.soft_emb_eps = eps
        self.projection = nn.Parameter(torch.zeros(hidden, text_hidden))

    @torch.inference_mode()
    def encode(self, item: ImageItem) -> torch.Tensor:
        """(num_embeds, text hidden) in the tower's dtype."""
        dtype = self.projection.dtype
        x = self.patch_embedding(item.pixel_values[None].to(self.projection.device, dtype))  # (1, hidden, n, n)
        # NOTE: contiguous rows: the sum would keep the conv output's transposed strides, and every layer's norm
        # and residual add would then copy or stride across them (~70 ms a layer at 896 px).
        x = x.flatten(2)[0].transpose(0, 1).contiguous() + self.position_embedding  # (P, hidden)
        buffers = SiglipBuffers.like(x, self.layers[0].fc1.out_features) if self.layers else None
        for layer in self.layers:
            x = layer(x, buffers)
        x = self.post_layernorm(x)
        n = self.patches_per_side
        grid = x.transpose(0, 1).reshape(1, -1, n, n)  # (1, hidden, n, n)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2)[0].transpose(0, 1)  # (N, hidden)
        normed = pooled.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.soft_emb_eps)
        normed = (normed * (1.0 + self.soft_emb_norm.float())).to(dtype)
        return torch.matmul(normed, self.projection)

    def load(self, weights: dict[str, Any], dtype: torch.dtype) -> None:
        """HF names, either layout of TOWER_PREFIXES / PROJECTOR_PREFIXES."""
        tower = find_prefix(weights, TOWER_PREFIXES, "embeddings.patch_embedding.weight", "gemma3")
        projector = find_prefix(weights, PROJECTOR_PREFIXES, "mm_input_projection_weight", "gemma3")
        names = {
            "patch_embedding.weight": tower + "embeddings.patch_embedding.weight",
            "patch_embedding.bias": tower + "embeddings.patch_embedding.bias",
            "position_embedding": tower + "embeddings.position_embedding.weight",
            "post_layernorm.weight": tower + "post_layernorm.weight",
            "post_layernorm.bias": tower + "post_layernorm.bias",
            "soft_emb_norm": projector + "mm_soft_emb_norm.weight",
            "projection": projector + "mm_input_projection_weight",
        }
        names.update(siglip_layer_names(tower, len(self.layers)))
        load_renamed(self, weights, names, dtype, "gemma3")


def build_vision(checkpoint: VisionCheckpoint, tokenizer: Any, dtype: torch.dtype, device: torch.device,
                 ops: KernelBackend | None = None) -> VisionModel:
    encoder = Gemma3VisionEncoder(checkpoint.config, ops)
    encoder.load(checkpoint.weights, dtype)
    return VisionModel(Gemma3Processor(checkpoint.config, checkpoint.processor_config, tokenizer),
                       encoder.to(device), checkpoint.model_type)
