"""LFM2-VL's vision side: the processor (smart resize to a token budget, or a large image split into tile_size tiles
plus a smart-resized thumbnail; rescale + normalize; patchify) and the tower (SigLIP2 NaFlex: linear patch embed,
learned positions resized per image, SigLIP layers, post layer norm) with its projector (pixel unshuffle by
downsample_factor, layer norm, linear-GELU-linear), as transformers' Lfm2VlImageProcessor / Lfm2VlProcessor /
Siglip2VisionModel / Lfm2VlMultiModalProjector compute them.

NOTE: transformers has only a torchvision ("fast") image processor for LFM2-VL and torchvision is not installed here,
so the processor is written from its code: the resize is torchvision's (`F.interpolate` bilinear + antialias, on
uint8 where the CPU has AVX2 as torchvision chooses, else float32 rounded back), the normalization its fused one.

Each frame (tile or thumbnail, or the one resized image) is encoded alone and unpadded: transformers pads frames to
max_num_patches and masks the padding out of attention, so a frame's real rows are the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.preprocess import ImageRun, TextPieces, expand_markers
from conveyor.multimodal.siglip import SiglipLayer, siglip_layer_names
from conveyor.multimodal.tower_weights import find_prefix, load_renamed
from conveyor.multimodal.vision import ExpandedPrompt, ImageItem, VisionCheckpoint, VisionModel

TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# Siglip2VisionConfig's defaults, where a config.json's vision_config leaves a field out
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, num_patches=256, patch_size=16, layer_norm_eps=1e-6)
# Lfm2VlImageProcessor's class defaults
PROCESSOR_DEFAULTS = dict(downsample_factor=2, do_image_splitting=True, min_tiles=2, max_tiles=10, use_thumbnail=True,
                          min_image_tokens=64, max_image_tokens=256, encoder_patch_size=16, tile_size=512,
                          max_pixels_tolerance=2.0, rescale_factor=1 / 255, do_rescale=True, do_normalize=True,
                          image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def _round_by(number: float, factor: int) -> int:
    return round(number / factor) * factor


@lru_cache(maxsize=16)
def _target_ratios(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    ratios = [(w, h) for n in range(min_tiles, max_tiles + 1) for w in range(1, n + 1) for h in range(1, n + 1)
              if min_tiles <= w * h <= max_tiles]
    # NOTE: ties in area keep the set's iteration order, as transformers' (a tie in aspect goes to the later one)
    return sorted(set(ratios), key=lambda r: r[0] * r[1])


def _closest_ratio(aspect: float, ratios: list[tuple[int, int]], width: int, height: int, tile: int) -> tuple[int, int]:
    """find_closest_aspect_ratio, verbatim: a tie goes to the later ratio when the image covers half its area."""
    best_diff, best = float("inf"), (1, 1)
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and width * height > 0.5 * tile * tile * ratio[0] * ratio[1]:
            best = ratio
    return best


def resize_like_torchvision(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(3, H, W) uint8 -> (3, height, width) uint8, as torchvision.transforms.v2.functional.resize (bilinear,
    antialias) computes it on a CPU: uint8 straight through where torch reports AVX2, else float32 rounded back."""
    if tuple(pixels.shape[-2:]) == (height, width):
        return pixels
    # NOTE: torchvision tests for the substring "AVX2", so an AVX512 CPU takes the float path
    if "AVX2" in torch.backends.cpu.get_cpu_capability():
        return F.interpolate(pixels[None], size=(height, width), mode="bilinear", align_corners=False,
                             antialias=True)[0]
    out = F.interpolate(pixels[None].float(), size=(height, width), mode="bilinear", align_corners=False,
                        antialias=True)[0]
    return out.round_().to(torch.uint8)


class Lfm2VlProcessor:
    """`<image>` -> `<|image_start|>` + (split) per tile `<|img_row_r_col_c|>` + tile_tokens x `<image>`, then
    `<|img_thumbnail|>` + thumbnail_tokens x `<image>`; (not split) tokens x `<image>`; + `<|image_end|>`. The marker
    is `<image>` itself (what LFM2-VL's chat template writes). Each piece is a special token, so they are
    tokenized alone."""

    def __init__(self, raw: dict[str, Any], processor_config: dict[str, Any], tokenizer: Any) -> None:
        self.image_marker_id = int(raw.get("image_token_id", raw.get("image_token_index", 396)))
        self.image_marker = tokenizer.decode([self.image_marker_id], skip_special_tokens=False)
        cfg = {**PROCESSOR_DEFAULTS, **processor_config}
        self.factor = int(cfg["downsample_factor"])
        self.patch = int(cfg["encoder_patch_size"])
        self.tile = int(cfg["tile_size"])
        self.split = bool(cfg["do_image_splitting"])
        self.min_tiles, self.max_tiles = (int(cfg["min_tiles"]), int(cfg["max_tiles"])) if self.split else (1, 1)
        if self.min_tiles > self.max_tiles:
            raise ValueError("lfm2_vl: min_tiles must be at most max_tiles")
        self.use_thumbnail = bool(cfg["use_thumbnail"])
        self.min_tokens, self.max_tokens = int(cfg["min_image_tokens"]), int(cfg["max_image_tokens"])
        self.tolerance = float(cfg["max_pixels_tolerance"])
        self.special = bool(processor_config.get("use_image_special_tokens", True))
        if int(cfg.get("resample", 2)) != 2:
            raise ValueError("lfm2_vl: only bilinear resampling (resample 2) is supported")
        if not (cfg["do_rescale"] and cfg["do_normalize"]):
            raise ValueError("lfm2_vl: do_rescale and do_normalize off are not supported")
        # torchvision's fused rescale + normalize: (x - mean / r) / (std / r) in float32
        self.mean = torch.tensor(cfg["image_mean"], dtype=torch.float32) * (1.0 / float(cfg["rescale_factor"]))
        self.std = torch.tensor(cfg["image_std"], dtype=torch.float32) * (1.0 / float(cfg["rescale_factor"]))
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        if int(vision["patch_size"]) != self.patch or int(raw.get("downsample_factor", 2)) != self.factor:
            raise ValueError("lfm2_vl: the processor's encoder_patch_size / downsample_factor differ from the model's")
        if self.tile % (self.patch * self.factor):
            raise ValueError(f"lfm2_vl: tile_size {self.tile} is not a whole number of patch x downsample_factor")
        self.pieces = TextPieces(tokenizer)

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        """(height, width): both whole patch x factor units, the area within min..max image tokens."""
        unit = self.patch * self.factor
        lo, hi = self.min_tokens * unit * unit, self.max_tokens * unit * unit
        h, w = max(unit, _round_by(height, unit)), max(unit, _round_by(width, unit))
        if h * w > hi:
            beta = math.sqrt(height * width / hi)
            h = max(unit, math.floor(height / beta / unit) * unit)
            w = max(unit, math.floor(width / beta / unit) * unit)
        elif h * w < lo:
            beta = math.sqrt(lo / (height * width))
            h, w = math.ceil(height * beta / unit) * unit, math.ceil(width * beta / unit) * unit
        return h, w

    def layout(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(rows, cols, resized height, resized width): rows = cols = 1 for an image not split; else the tile grid
        and the thumbnail's size."""
        unit = self.patch * self.factor
        h, w = max(self.patch, _round_by(height, unit)), max(self.patch, _round_by(width, unit))
        large = h * w > self.max_tokens * unit * unit * self.tolerance
        new_h, new_w = self.smart_resize(height, width)
        if not (large and not self.min_tiles == self.max_tiles == 1):
            return 1, 1, new_h, new_w
        cols, rows = _closest_ratio(width / height, _target_ratios(self.min_tiles, self.max_tiles), width, height,
                                    self.tile)
        return rows, cols, new_h, new_w

    def frames(self, image: ImageInput) -> tuple[list[torch.Tensor], int, int, tuple[int, int]]:
        """The image's frames as (3, h, w) uint8 (tiles row by row, then the thumbnail; or the one resized image),
        the grid and the thumbnail's (or the image's) resized size."""
        pixels = torch.from_numpy(np.array(image.image)).permute(2, 0, 1).contiguous()  # ImageInput is RGB already
        height, width = pixels.shape[-2:]
        rows, cols, new_h, new_w = self.layout(height, width)
        if rows == cols == 1:
            return [resize_like_torchvision(pixels, new_h, new_w)], 1, 1, (new_h, new_w)
        big = resize_like_torchvision(pixels, rows * self.tile, cols * self.tile)
        tiles = [big[:, r * self.tile:(r + 1) * self.tile, c * self.tile:(c + 1) * self.tile]
                 for r in range(rows) for c in range(cols)]
        if self.use_thumbnail:
            tiles.append(resize_like_torchvision(pixels, new_h, new_w))
        return tiles, rows, cols, (new_h, new_w)

    def patches(self, frame: torch.Tensor) -> torch.Tensor:
        """(3, h, w) uint8 -> (h/p * w/p, p * p * 3) float32 normalized patches, each row-major (y, x, channel)."""
        x = (frame.to(torch.float32) - self.mean[:, None, None]) / self.std[:, None, None]
        c, h, w = x.shape
        p = self.patch
        x = x.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0)  # (gh, gw, p, p, c)
        return x.reshape((h // p) * (w // p), p * p * c)

    def _tokens(self, height: int, width: int) -> int:
        return math.ceil((height // self.patch) / self.factor) * math.ceil((width // self.patch) / self.factor)

    def run(self, rows: int, cols: int, size: tuple[int, int]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        """One image's token ids and its embed runs (one per frame, in frame order)."""
        ids: list[int] = list(self.pieces("<|image_start|>")) if self.special else []
        runs: list[tuple[int, int]] = []

        def frame(head: str | None, n: int) -> None:
            if head is not None and self.special:
                ids.extend(self.pieces(head))
            runs.append((len(ids), n))
            ids.extend([self.image_marker_id] * n)

        if rows > 1 or cols > 1:
            for r in range(rows):
                for c in range(cols):
                    frame(f"<|img_row_{r + 1}_col_{c + 1}|>", self._tokens(self.tile, self.tile))
            if self.use_thumbnail:
                frame("<|img_thumbnail|>", self._tokens(*size))
        else:
            frame(None, self._tokens(*size))
        if self.special:
            ids.extend(self.pieces("<|image_end|>"))
        return ids, tuple(runs)

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence[ImageInput]) -> ExpandedPrompt:
        return ExpandedPrompt(*expand_markers(prompt_token_ids, self.image_marker_id, self.image_marker, images,
                                              self._image_run))

    def _image_run(self, image: ImageInput) -> ImageRun:
        frames, rows, cols, size = self.frames(image)
        ids, runs = self.run(rows, cols, size)
        shapes = [(f.shape[1] // self.patch, f.shape[2] // self.patch) for f in frames]
        pixels = torch.cat([self.patches(f) for f in frames])  # (sum of patches, p * p * 3)
        return ImageRun(ids, runs, pixels, {"rows": rows, "cols": cols, "shapes": shapes})


def resize_positions(table: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(G, G, D) learned positions -> (height * width, D): F.interpolate(bilinear, antialias) of the grid to
    (height, width), in Siglip2VisionEmbeddings.resize_positional_embeddings' closed form (per-axis weights)."""
    grid = table.shape[0]

    def axis(size: int) -> torch.Tensor:  # (size, G) weights of one axis
        scale = grid / size
        support = max(scale, 1.0)
        center = (torch.arange(size, dtype=torch.float32) + 0.5) * scale - 0.5
        source = torch.arange(grid, dtype=torch.float32)
        w = (1 - (source[None] - center[:, None]).abs() / support).clamp(min=0)
        return w / w.sum(-1, keepdim=True)

    weights = (axis(height)[:, None, :, None] * axis(width)[None, :, None, :]).reshape(height * width, grid * grid)
    return (weights @ table.reshape(grid * grid, -1).float()).to(table.dtype)


class Lfm2VlVisionEncoder(nn.Module):
    """Siglip2VisionModel (linear patch embed, resized positions, SigLIP layers, post_layernorm) + the projector."""

    def __init__(self, raw: dict[str, Any], ops: KernelBackend | None = None) -> None:
        super().__init__()
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        if vision.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"lfm2_vl vision: hidden_act {vision['hidden_act']} is not supported")
        hidden, eps = int(vision["hidden_size"]), float(vision["layer_norm_eps"])
        self.patch = int(vision["patch_size"])
        channels = int(vision["num_channels"])
        self.grid = int(int(vision["num_patches"]) ** 0.5)
        self.patch_embedding = nn.Linear(channels * self.patch * self.patch, hidden)
        self.position_embedding = nn.Parameter(torch.zeros(self.grid * self.grid, hidden))
        self.layers = nn.ModuleList(
            SiglipLayer(hidden, int(vision["intermediate_size"]), int(vision["num_attention_heads"]), eps, ops)
            for _ in range(int(vision["num_hidden_layers"])))
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.factor = int(raw.get("downsample_factor", 2))
        merged = hidden * self.factor ** 2
        bias = bool(raw.get("projector_bias", True))
        self.use_norm = bool(raw.get("projector_use_layernorm", True))
        self.layer_norm = nn.LayerNorm(merged) if self.use_norm else None
        if raw.get("projector_hidden_act", "gelu") != "gelu":
            raise ValueError(f"lfm2_vl: projector_hidden_act {raw['projector_hidden_act']} is not supported")
        self.linear_1 = nn.Linear(merged, int(raw.get("projector_hidden_size", 2560)), bias=bias)
        self.linear_2 = nn.Linear(int(raw.get("projector_hidden_size", 2560)), int(raw["text_config"]["hidden_size"]),
                                  bias=bias)

    @torch.inference_mode()
    def encode(self, item: ImageItem) -> torch.Tensor:
        """(sum of frame tokens, text hidden) in the tower's dtype, one frame at a time."""
        weight = self.linear_2.weight
        out, start = [], 0
        for h, w in item.extras["shapes"]:
            n = h * w
            out.append(self._frame(item.pixel_values[start:start + n].to(weight.device, weight.dtype), h, w))
            start += n
        return torch.cat(out)

    def _frame(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        table = self.position_embedding.view(self.grid, self.grid, -1)
        x = self.patch_embedding(patches) + resize_positions(table, h, w)  # (h * w, hidden)
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        f, d = self.factor, x.shape[-1]
        # pixel unshuffle: each f x f block of patches -> one token, its rows' patches left to right, top to bottom
        x = x.view(h // f, f, w // f, f, d).permute(0, 2, 1, 3, 4).reshape(-1, f * f * d)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.linear_2(F.gelu(self.linear_1(x)))

    def load(self, weights: dict[str, Any], dtype: torch.dtype) -> None:
        tower = find_prefix(weights, TOWER_PREFIXES, "embeddings.patch_embedding.weight", "lfm2_vl")
        projector = find_prefix(weights, PROJECTOR_PREFIXES, "linear_1.weight", "lfm2_vl")
        names = {
            "patch_embedding.weight": tower + "embeddings.patch_embedding.weight",
            "patch_embedding.bias": tower + "embeddings.patch_embedding.bias",
            "position_embedding": tower + "embeddings.position_embedding.weight",
            "post_layernorm.weight": tower + "post_layernorm.weight",
            "post_layernorm.bias": tower + "post_layernorm.bias",
        }
        for part in ("linear_1", "linear_2") + (("layer_norm",) if self.use_norm else ()):
            for kind in ("weight", "bias"):
                if part == "layer_norm" or getattr(self, part).bias is not None or kind == "weight":
                    names[f"{part}.{kind}"] = f"{projector}{part}.{kind}"
        names.update(siglip_layer_names(tower, len(self.layers)))
        load_renamed(self, weights, names, dtype, "lfm2_vl")


def build_vision(checkpoint: VisionCheckpoint, tokenizer: Any, dtype: torch.dtype, device: torch.device,
                 ops: KernelBackend | None = None) -> VisionModel:
    encoder = Lfm2VlVisionEncoder(checkpoint.config, ops)
    encoder.load(checkpoint.weights, dtype)
    return VisionModel(Lfm2VlProcessor(checkpoint.config, checkpoint.processor_config, tokenizer),
                       encoder.to(device), checkpoint.model_type)
