"""Qwen3-VL's and Qwen3.5's vision side: the processor (Qwen2-VL's smart_resize to whole patch x merge units between
min and max pixels, rescale, normalize, patchify with the frame repeated over temporal_patch_size; `<|image_pad|>` ->
one `<|image_pad|>` per merged patch, as Qwen3VLProcessor writes it; the multimodal rotary positions of
get_rope_index), the tower (Conv3d patch embed as one GEMM, learned position table bilinearly resampled to the grid,
2D axial rotary q / k, LayerNorm blocks, the 2 x 2 patch merger, and Qwen3-VL's DeepStack mergers), as transformers'
Qwen2VLImageProcessorPil / Qwen3VLProcessor / Qwen3VLVisionModel / Qwen3_5VisionModel compute them.

The text models (models/hybrid.py, models/qwen3_vl.py) rotate image prompts by `rope_positions` (models/mrope.py).

    prompt   <|vision_start|> <|image_pad|> <|vision_end|>
    expanded <|vision_start|> <|image_pad|> x (grid_h / 2) (grid_w / 2) <|vision_end|>   embed_runs = ((0, N),)

DeepStack (Qwen3-VL): the outputs of the blocks in deepstack_visual_indexes go through mergers of their own; the
encoder returns them beside the main rows, side by side along the hidden dim as llama.cpp's mmproj does,

    rows (N, hidden * (1 + levels)) = [ main | level 0 | level 1 | ... ]

so the runner, the encoder cache and the prefix cache carry one tensor per image; the text model
(models/qwen3_vl.py) takes the main part as the rows' input and adds level i after decoder layer i.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from conveyor.errors import InvalidRequestError
from conveyor.kernels import KernelBackend
from conveyor.kernels.attention import reference_dense_attention
from conveyor.models.mrope import axis_of_columns
from conveyor.models.qwen3_5 import MROPE_SECTION as QWEN3_5_MROPE_SECTION
from conveyor.models.qwen3_vl import MROPE_SECTION as QWEN3_VL_MROPE_SECTION
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.preprocess import (CLIP_MEAN, CLIP_STD, ImageRun, PixelNormalizer, activation, expand_markers,
                                          resample_filter)
from conveyor.multimodal.tower_weights import find_prefix, renamed_state
from conveyor.multimodal.vision import ExpandedPrompt, ImageItem, VisionCheckpoint, VisionModel

TOWER_PREFIXES = ("model.visual.", "visual.")  # transformers 5's layout, then the Hub's
# Qwen3_5VisionConfig's defaults, where a config.json's vision_config leaves a field out
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                       num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       out_hidden_size=3584, num_position_embeddings=2304)
# What differs in Qwen3-VL's config classes: Qwen3VLVisionConfig's DeepStack layers, Qwen3VLConfig's image token,
# Qwen3VLTextConfig's M-RoPE sections (Qwen3.5's: [11, 11, 10])
_QWEN3_VL = dict(deepstack_visual_indexes=(8, 16, 24), image_token_id=151655, mrope_section=QWEN3_VL_MROPE_SECTION)
FAMILY_DEFAULTS = {"qwen3_vl": _QWEN3_VL, "qwen3_vl_moe": _QWEN3_VL}
QWEN3_5_DEFAULTS = dict(deepstack_visual_indexes=(), image_token_id=248056, mrope_section=QWEN3_5_MROPE_SECTION)
TOWER_EPS = 1e-6  # hard-coded in modeling_qwen3_5.py (every LayerNorm)


def family_defaults(model_type: str | None) -> dict[str, Any]:
    return FAMILY_DEFAULTS.get(model_type or "", QWEN3_5_DEFAULTS)


def vision_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's vision_config over its config class' defaults."""
    deepstack = family_defaults(raw.get("model_type"))["deepstack_visual_indexes"]
    return {**VISION_DEFAULTS, "deepstack_visual_indexes": deepstack, **(raw.get("vision_config") or {})}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's smart_resize: both edges whole `factor`s, the area within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError(f"an image's aspect ratio must be under 200 (got {width} x {height})", "messages")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def rope_positions(token_ids: Sequence[int], items: Sequence[ImageItem],
                   merge: int) -> tuple[tuple[list[int], list[int], list[int]], int]:
    """get_rope_index for one prompt: text rows count on from the last position on all three axes; an image's rows
    sit at (start, start + row, start + col) over its merged grid and move the count on by max(rows, cols).
    Returns the (t, h, w) lists and the delta (max position + 1 - length) later rows add."""
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []
    pos, cursor = 0, 0
    for item in items:
        ((start, count),) = item.embed_runs
        first = item.offset + start
        for _ in range(first - cursor):
            t.append(pos), h.append(pos), w.append(pos)
            pos += 1
        rows, cols = item.extras["grid_h"] // merge, item.extras["grid_w"] // merge
        for r in range(rows):
            for c in range(cols):
                t.append(pos), h.append(pos + r), w.append(pos + c)
        pos += max(rows, cols)
        cursor = first + count
    for _ in range(len(token_ids) - cursor):
        t.append(pos), h.append(pos), w.append(pos)
        pos += 1
    top = max(max(t, default=-1), max(h, default=-1), max(w, default=-1))
    return (t, h, w), top + 1 - len(token_ids)


class QwenVLProcessor:
    """`<|image_pad|>` (the marker: Qwen's chat templates write `<|vision_start|><|image_pad|><|vision_end|>` per
    image part) -> one `<|image_pad|>` per merged patch; the start / end tokens stay as the template wrote them."""

    def __init__(self, raw: dict[str, Any], processor_config: dict[str, Any], tokenizer: Any) -> None:
        vision = vision_settings(raw)
        family = raw.get("model_type", "qwen3_5")
        self.image_marker_id = int(raw.get("image_token_id", family_defaults(raw.get("model_type"))["image_token_id"]))
        # The marker text a text-only template's image part becomes (request_plan.py): wrapped in the vision start /
        # end tokens as Qwen's templates write it (llama.cpp's mtmd adds them too), so the prompt is the same.
        wrap = [raw.get("vision_start_token_id"), self.image_marker_id, raw.get("vision_end_token_id")]
        ids = [int(t) for t in wrap] if None not in wrap else [self.image_marker_id]
        self.image_marker = "".join(tokenizer.decode([t], skip_special_tokens=False) for t in ids)
        self.patch = int(vision["patch_size"])
        self.merge = int(vision["spatial_merge_size"])
        self.temporal = int(vision["temporal_patch_size"])
        for key, ours in (("patch_size", self.patch), ("merge_size", self.merge),
                          ("temporal_patch_size", self.temporal)):
            theirs = processor_config.get(key)
            if theirs is not None and int(theirs) != ours:
                raise ValueError(f"{family}: the processor's {key} {theirs} != the tower's {ours}")
        size = processor_config.get("size") or {}
        self.min_pixels = int(processor_config.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(processor_config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if not processor_config.get(flag, True):
                raise ValueError(f"{family}: {flag} false is not supported")
        self.resample = resample_filter(processor_config, 3)  # bicubic
        self.normalize = PixelNormalizer.from_config(processor_config, CLIP_MEAN, CLIP_STD)

    def pixels(self, image: ImageInput) -> tuple[torch.Tensor, int, int]:
        """(grid_h * grid_w, 3 * temporal * patch * patch) float32 patches in merge-block order, grid_h, grid_w:
        PIL resize, x * rescale in float64 -> float32, (x - mean) / std in float32, then patchify."""
        height, width = smart_resize(image.image.height, image.image.width, self.patch * self.merge,
                                     self.min_pixels, self.max_pixels)
        x = self.normalize(image.image.resize((width, height), resample=self.resample))  # (3, H, W)
        p, m = self.patch, self.merge
        gh, gw = height // p, width // p
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.temporal, p, p))
        return torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, -1)), gh, gw

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence[ImageInput]) -> ExpandedPrompt:
        out, items = expand_markers(prompt_token_ids, self.image_marker_id, self.image_marker, images,
                                    self._image_run)
        if not items:  # a text-only prompt: plain positions, as get_rope_index gives it
            return ExpandedPrompt(out, items)
        positions, delta = rope_positions(out, items, self.merge)
        return ExpandedPrompt(out, items, rope_positions=positions, rope_delta=delta)

    def _image_run(self, image: ImageInput) -> ImageRun:
        patches, gh, gw = self.pixels(image)
        n = gh * gw // (self.merge * self.merge)
        return ImageRun([self.image_marker_id] * n, ((0, n),), patches, {"grid_h": gh, "grid_w": gw})


def _axial_rope(grid_h: int, grid_w: int, merge: int, head_dim: int, theta: float) -> tuple[torch.Tensor, ...]:
    """(P, head_dim) float32 cos, sin in merge-block patch order: the first half of each rotation pair's angles
    from the row, the rest from the column (Qwen3_5VisionRotaryEmbedding)."""
    hpos, wpos = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    hpos, wpos = (p.reshape(shape).transpose(1, 2).flatten() for p in (hpos, wpos))
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
    fh, fw = hpos[:, None].float() * inv_freq, wpos[:, None].float() * inv_freq
    freqs = torch.cat([fh, fw], dim=-1)
    freqs = torch.cat([freqs, freqs], dim=-1)
    return freqs.cos(), freqs.sin()


def _interpolation(grid_h: int, grid_w: int, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, 4) indices into the flattened side x side position table and their bilinear weights (align_corners),
    in merge-block patch order (get_vision_interpolation_indices_and_weights for one image)."""
    within = torch.arange(grid_h * grid_w)
    blocks_w = grid_w // merge
    row = (within // (merge * merge * blocks_w)) * merge + (within // merge) % merge
    col = ((within // (merge * merge)) % blocks_w) * merge + within % merge

    def taps(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.float() * (side - 1) / max(size - 1, 1)
        floor = torch.floor(src)
        offsets = torch.arange(0, 2)
        at = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        weight = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return at, weight

    h_at, h_w = taps(row, grid_h)
    w_at, w_w = taps(col, grid_w)
    index = (h_at[:, :, None] * side + w_at[:, None, :]).reshape(-1, 4)  # (P, 4): the 2 x 2 taps
    return index, (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """As apply_rotary_pos_emb_vision: fp32 rotation, back to x's dtype; x (P, heads, head_dim)."""
    h = x.float()
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class QwenVisionBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, act: str, ops: KernelBackend | None) -> None:
        super().__init__()
        self.heads, self.ops = heads, ops
        self.norm1 = nn.LayerNorm(hidden, eps=TOWER_EPS)
        self.norm2 = nn.LayerNorm(hidden, eps=TOWER_EPS)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act, "qwen3_vl vision")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(hidden, dim=1)
        q, k = (_rotate(t.reshape(rows, self.heads, -1), cos, sin).reshape(rows, hidden) for t in (q, k))
        attend = self.ops.dense_attention if self.ops is not None else reference_dense_attention
        # (v stays a column slice of the fused qkv: dense_attention reads it in place, no copy)
        x = x + self.proj(attend(q, k, v, self.heads, (hidden // self.heads) ** -0.5))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class PatchMerger(nn.Module):
    """2 x 2 neighbouring patches -> one text-wide row (Qwen3VLVisionPatchMerger): LayerNorm per patch (the main
    merger) or over the merged row (`postshuffle`: DeepStack's), then fc1, exact GELU, fc2."""

    def __init__(self, hidden: int, merge: int, out: int, postshuffle: bool) -> None:
        super().__init__()
        self.merged = hidden * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else hidden, eps=TOWER_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class QwenVisionEncoder(nn.Module):
    """Patches -> merged rows (num_embeds, out_hidden_size * (1 + DeepStack levels)). One image per encode: full
    attention over its patches (transformers' cu_seqlens blocks are one image each)."""

    def __init__(self, vision: dict[str, Any], ops: KernelBackend | None = None) -> None:
        super().__init__()
        hidden = int(vision["hidden_size"])
        self.merge = int(vision["spatial_merge_size"])
        self.head_dim = hidden // int(vision["num_heads"])
        self.theta = float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.side = int(int(vision["num_position_embeddings"]) ** 0.5)
        patch_dim = int(vision["in_channels"]) * int(vision["temporal_patch_size"]) * int(vision["patch_size"]) ** 2
        self.patch_embed = nn.Linear(patch_dim, hidden)  # the Conv3d (stride = kernel) as one GEMM
        self.pos_embed = nn.Embedding(int(vision["num_position_embeddings"]), hidden)
        depth = int(vision["depth"])
        self.blocks = nn.ModuleList(
            QwenVisionBlock(hidden, int(vision["intermediate_size"]), int(vision["num_heads"]),
                            str(vision["hidden_act"]), ops) for _ in range(depth))
        out = int(vision["out_hidden_size"])
        self.merger = PatchMerger(hidden, self.merge, out, postshuffle=False)
        self.deepstack = [int(i) for i in vision.get("deepstack_visual_indexes") or ()]
        if any(not 0 <= i < depth for i in self.deepstack) or len(set(self.deepstack)) != len(self.deepstack):
            raise ValueError(f"qwen3_vl: deepstack_visual_indexes {self.deepstack} must be distinct blocks of the "
                             f"{depth}-block tower")
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(hidden, self.merge, out, postshuffle=True) for _ in self.deepstack)

    @property
    def num_levels(self) -> int:
        """DeepStack levels beside the main rows (0: Qwen3.5's tower)."""
        return len(self.deepstack)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(patches.to(dtype))
        at, weight = _interpolation(grid_h, grid_w, self.merge, self.side)
        x = x + (self.pos_embed(at.to(x.device)) * weight.to(x.device, dtype)[:, :, None]).sum(1).to(dtype)
        cos, sin = (t.to(x.device) for t in _axial_rope(grid_h, grid_w, self.merge, self.head_dim, self.theta))
        levels: list[torch.Tensor] = []  # in block order, as transformers lists them (merger k: the k-th index)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if i in self.deepstack:
                levels.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *levels], dim=1) if levels else self.merger(x)

    @torch.inference_mode()
    def encode(self, item: ImageItem) -> torch.Tensor:
        patches = item.pixel_values.to(self.patch_embed.weight.device)
        return self.forward(patches, item.extras["grid_h"], item.extras["grid_w"])

    def load_hf(self, weights: dict[str, Any], prefix: str) -> None:
        """transformers' names under `prefix` (model.visual.) -> ours; the Conv3d kernel flattened to the GEMM's."""
        names = {"patch_embed.weight": "patch_embed.proj.weight", "patch_embed.bias": "patch_embed.proj.bias",
                 "pos_embed.weight": "pos_embed.weight"}
        ours = {"norm1": "norm1", "norm2": "norm2", "qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.linear_fc1",
                "fc2": "mlp.linear_fc2"}
        for i in range(len(self.blocks)):
            for mine, theirs in ours.items():
                for part in ("weight", "bias"):
                    names[f"blocks.{i}.{mine}.{part}"] = f"blocks.{i}.{theirs}.{part}"
        mergers = ["merger"] + [f"deepstack_merger_list.{k}" for k in range(len(self.deepstack))]
        for merger in mergers:  # our names are transformers'
            for layer in ("norm", "linear_fc1", "linear_fc2"):
                for part in ("weight", "bias"):
                    names[f"{merger}.{layer}.{part}"] = f"{merger}.{layer}.{part}"
        state = renamed_state(weights, {mine: prefix + theirs for mine, theirs in names.items()},
                              self.patch_embed.weight.dtype, "qwen3_vl")
        state["patch_embed.weight"] = state["patch_embed.weight"].reshape(self.patch_embed.weight.shape)
        self.load_state_dict(state, strict=True)


def tower_prefix(weights: dict[str, Any]) -> str:
    return find_prefix(weights, TOWER_PREFIXES, "patch_embed.proj.weight", "qwen3_vl")


def check_mrope_section(raw: dict[str, Any]) -> None:
    """The text model's M-RoPE sections (t, h, w) must cover half its rotary width: a load error here, not an
    error at the first image prompt (the text rows rotate as plain rope whatever the sections say)."""
    text = raw.get("text_config") or {}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section") or family_defaults(raw.get("model_type"))["mrope_section"]
    if "head_dim" not in text and not ("hidden_size" in text and "num_attention_heads" in text):
        return  # an mmproj's config names no text model: the text GGUF's family checks its own sections
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    try:
        axis_of_columns(section, int(head_dim * partial))
    except ValueError as exc:
        raise ValueError(f"{raw.get('model_type')}: {exc}") from exc


def build_vision(checkpoint: VisionCheckpoint, tokenizer: Any, dtype: torch.dtype, device: torch.device,
                 ops: KernelBackend | None = None) -> VisionModel:
    raw = checkpoint.config
    check_mrope_section(raw)
    encoder = QwenVisionEncoder(vision_settings(raw), ops)
    encoder.load_hf(checkpoint.weights, tower_prefix(checkpoint.weights))
    encoder.to(device=device, dtype=dtype).eval()
    processor = QwenVLProcessor(raw, checkpoint.processor_config, tokenizer)
    return VisionModel(processor, encoder, checkpoint.model_type, num_levels=encoder.num_levels)
