"""Idefics3 / SmolVLM's vision side: the processor (resize the longest edge, split into max_image_size tiles plus a
downscaled global image, rescale, normalize; `<image>` -> its tiles' token runs) and the tower (SigLIP with
bucketed positions, pixel shuffle, modality projection), as transformers' Idefics3ImageProcessorPil /
Idefics3Processor / Idefics3VisionTransformer / Idefics3Connector compute them.

Every frame of one image is max_image_size square (tiles are crops of an image resized to whole tiles), so no
pixel padding: the pixel attention mask is all ones and the bucketed position ids are 0..P-1 in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.preprocess import HALF, ImageRun, PixelNormalizer, TextPieces, expand_markers, resample_filter
from conveyor.multimodal.siglip import SiglipLayer, siglip_layer_names
from conveyor.multimodal.tower_weights import find_prefix, load_renamed
from conveyor.multimodal.vision import ExpandedPrompt, ImageItem, VisionCheckpoint, VisionModel

TOWER_PREFIXES = ("model.vision_model.", "vision_model.", "vision_tower.vision_model.")  # the last: --mmproj
CONNECTOR_PREFIXES = ("model.connector.", "connector.")
# Idefics3VisionConfig's defaults, where a config.json's vision_config leaves a field out
VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                       image_size=224, patch_size=32, layer_norm_eps=1e-6, num_channels=3)
MAX_IMAGE_SIZE = 4096  # transformers' absolute bound on a resized edge


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The longest edge to max_len, the other by the aspect ratio, rounded up to even (HF's helper, verbatim)."""
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


class Idefics3Processor:
    """`<image>` -> (split) per tile `<fake_token_around_image><row_r_col_c>` + N x `<image>`, a newline after each
    row, then `\\n<fake_token_around_image><global-img>` + N x `<image>` + `<fake_token_around_image>`; (not split)
    `<fake_token_around_image><global-img>` + N x `<image>` + `<fake_token_around_image>`. The marker is `<image>`
    itself, as the HF processor's text takes it. The text pieces between runs are tokenized alone: each starts and
    ends at a special token, so no merge crosses them."""

    def __init__(self, raw: dict[str, Any], processor_config: dict[str, Any], tokenizer: Any) -> None:
        self.image_marker_id = int(raw.get("image_token_id", raw.get("image_token_index", 128_257)))
        self.image_marker = tokenizer.decode([self.image_marker_id], skip_special_tokens=False)
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        scale = int(raw.get("scale_factor", 2))
        default_len = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2 // (scale * scale)
        self.image_seq_len = int(processor_config.get("image_seq_len", default_len))
        if self.image_seq_len != default_len:
            raise ValueError(f"idefics3: image_seq_len {self.image_seq_len} != the tower's {default_len}")
        self.longest_edge = int((processor_config.get("size") or {}).get("longest_edge", 4 * 364))
        self.tile = int((processor_config.get("max_image_size") or {}).get("longest_edge", 364))
        self.do_resize = bool(processor_config.get("do_resize", True))
        self.split = bool(processor_config.get("do_image_splitting", True))
        self.resample = resample_filter(processor_config, 1)  # Lanczos
        self.normalize = PixelNormalizer.from_config(processor_config, HALF, HALF)
        self.pieces = TextPieces(tokenizer)

    def frames(self, image: ImageInput) -> tuple[list[Image.Image], int, int]:
        """The image's frames (tiles row by row, then the global image; or the one resized image) and the grid."""
        img = image.image
        if self.do_resize:
            h, w = _rescale_to_max_len(img.height, img.width, self.longest_edge)
            h, w = _scale_below(h, w, MAX_IMAGE_SIZE)
            img = img.resize((w, h), resample=self.resample)
        tile = self.tile
        if not self.split:
            return [img.resize((tile, tile), resample=self.resample)], 0, 0
        h, w = img.height, img.width  # resize to whole tiles (resize_for_vision_encoder)
        aspect = w / h
        if w >= h:
            w = math.ceil(w / tile) * tile
            h = math.ceil(int(w / aspect) / tile) * tile
        else:
            h = math.ceil(h / tile) * tile
            w = math.ceil(int(h * aspect) / tile) * tile
        img = img.resize((w, h), resample=self.resample)
        if h <= tile and w <= tile:
            return [img], 0, 0
        rows, cols = (h - tile) // tile + 1, (w - tile) // tile + 1
        tiles = [img.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                 for r in range(rows) for c in range(cols)]
        return tiles + [img.resize((tile, tile), resample=self.resample)], rows, cols

    def pixels(self, frames: list[Image.Image]) -> torch.Tensor:
        """(F, 3, S, S) float32, each frame normalized as Idefics3ImageProcessorPil does."""
        return torch.from_numpy(np.ascontiguousarray(np.stack([self.normalize(frame) for frame in frames])))

    def run(self, rows: int, cols: int) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        """One image's token ids and its embed runs (one per frame, in frame order)."""
        fake, n = "<fake_token_around_image>", self.image_seq_len
        heads = [f"{fake}<row_{r + 1}_col_{c + 1}>" for r in range(rows) for c in range(cols)]
        ids: list[int] = []
        runs: list[tuple[int, int]] = []
        for i, head in enumerate(heads):
            if i and i % cols == 0:
                head = "\n" + head
            ids += self.pieces(head)
            runs.append((len(ids), n))
            ids += [self.image_marker_id] * n
        ids += self.pieces(("\n\n" if heads else "") + f"{fake}<global-img>")
        runs.append((len(ids), n))
        ids += [self.image_marker_id] * n
        ids += self.pieces(fake)
        return ids, tuple(runs)

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence[ImageInput]) -> ExpandedPrompt:
        return ExpandedPrompt(*expand_markers(prompt_token_ids, self.image_marker_id, self.image_marker, images,
                                              self._image_run))

    def _image_run(self, image: ImageInput) -> ImageRun:
        frames, rows, cols = self.frames(image)
        ids, runs = self.run(rows, cols)
        return ImageRun(ids, runs, self.pixels(frames), {"rows": rows, "cols": cols})


class Idefics3VisionEncoder(nn.Module):
    """Idefics3VisionTransformer (patch conv, positions, pre-LN GELU-tanh layers, post_layernorm) + connector
    (pixel shuffle by scale_factor, one bias-free linear)."""

    def __init__(self, raw: dict[str, Any], ops: KernelBackend | None = None) -> None:
        super().__init__()
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        hidden, eps = int(vision["hidden_size"]), float(vision.get("layer_norm_eps", 1e-6))
        self.patch = int(vision["patch_size"])
        self.patches_per_side = int(vision["image_size"]) // self.patch
        self.patch_embedding = nn.Conv2d(int(vision.get("num_channels", 3)), hidden, self.patch, self.patch)
        self.position_embedding = nn.Parameter(torch.zeros(self.patches_per_side ** 2, hidden))
        self.layers = nn.ModuleList(
            SiglipLayer(hidden, int(vision["intermediate_size"]), int(vision["num_attention_heads"]), eps, ops)
            for _ in range(int(vision["num_hidden_layers"])))
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.scale = int(raw.get("scale_factor", 2))
        self.projection = nn.Linear(hidden * self.scale ** 2, int(raw["text_config"]["hidden_size"]), bias=False)

    @torch.inference_mode()
    def encode(self, item: ImageItem) -> torch.Tensor:
        """(frames x image_seq_len, text hidden) in the tower's dtype, one frame at a time (each frame's rows are
        its own: the same bits whatever else the image holds)."""
        dtype = self.projection.weight.dtype
        return torch.cat([self._frame(f[None].to(self.projection.weight.device, dtype))
                          for f in item.pixel_values])

    def _frame(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)  # (1, hidden, n, n)
        n = x.shape[-1]
        if n != self.patches_per_side or x.shape[-2] != n:
            raise ValueError(f"idefics3 vision: a frame of {tuple(pixels.shape[-2:])} px, the tower takes "
                             f"{self.patches_per_side * self.patch}")
        x = x.flatten(2)[0].transpose(0, 1).contiguous() + self.position_embedding  # (P, hidden): rows contiguous
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        s, d = self.scale, x.shape[-1]  # pixel shuffle, as Idefics3Connector.pixel_shuffle
        x = x.view(n, n // s, d * s).transpose(0, 1).reshape(n // s, n // s, d * s * s).transpose(0, 1)
        return self.projection(x.reshape(-1, d * s * s))

    def load(self, weights: dict[str, Any], dtype: torch.dtype) -> None:
        tower = find_prefix(weights, TOWER_PREFIXES, "embeddings.patch_embedding.weight", "idefics3")
        connector = find_prefix(weights, CONNECTOR_PREFIXES, "modality_projection.proj.weight", "idefics3")
        names = {
            "patch_embedding.weight": tower + "embeddings.patch_embedding.weight",
            "patch_embedding.bias": tower + "embeddings.patch_embedding.bias",
            "position_embedding": tower + "embeddings.position_embedding.weight",
            "post_layernorm.weight": tower + "post_layernorm.weight",
            "post_layernorm.bias": tower + "post_layernorm.bias",
            "projection.weight": connector + "modality_projection.proj.weight",
        }
        names.update(siglip_layer_names(tower, len(self.layers)))
        load_renamed(self, weights, names, dtype, "idefics3")


def build_vision(checkpoint: VisionCheckpoint, tokenizer: Any, dtype: torch.dtype, device: torch.device,
                 ops: KernelBackend | None = None) -> VisionModel:
    encoder = Idefics3VisionEncoder(checkpoint.config, ops)
    encoder.load(checkpoint.weights, dtype)
    return VisionModel(Idefics3Processor(checkpoint.config, checkpoint.processor_config, tokenizer),
                       encoder.to(device), checkpoint.model_type)
