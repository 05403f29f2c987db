"""Mistral 3's vision side: the processor (the longest edge down to size.longest_edge, both edges up to whole
patch x spatial_merge_size units, rescale, normalize; `[IMG]` -> its rows of `[IMG]` with `[IMG_BREAK]` at each row's
end and `[IMG_END]` last), the Pixtral tower (patch conv, RMSNorm, 2D rotary positions, SiLU/GELU-gated MLP) and the
Mistral 3 projector (RMSNorm, patch merger, linear -> GELU -> linear), as transformers' PixtralImageProcessorPil /
PixtralProcessor / PixtralVisionModel / Mistral3MultiModalProjector compute them. Pixtral 12B (model_type llava with
a Pixtral tower) is the same without the projector's norm and merger (LlavaMultiModalProjector).

One image per encode, so the tower's block-diagonal mask (one block per image) is full attention over its patches.

    [IMG] [IMG] [IMG] [IMG_BREAK]      one embed run per row of merged patches (the break / end tokens stay token
    [IMG] [IMG] [IMG] [IMG_END]        embeddings): embed_runs = ((0, 3), (4, 3))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from conveyor.kernels import KernelBackend
from conveyor.kernels.attention import reference_dense_attention
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.preprocess import (CLIP_MEAN, CLIP_STD, ImageRun, PixelNormalizer, activation, expand_markers,
                                          resample_filter)
from conveyor.multimodal.tower_weights import Names, find_prefix, load_renamed
from conveyor.multimodal.vision import ExpandedPrompt, ImageItem, VisionCheckpoint, VisionModel

TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")  # transformers 5's layout, then the Hub's
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# PixtralVisionConfig's defaults, where a config.json's vision_config leaves a field out
VISION_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       num_channels=3, patch_size=16, hidden_act="gelu")
TOWER_EPS = 1e-5  # hard-coded in modeling_pixtral.py (ln_pre and every layer's norms)


def _patch(value: Any, default: int) -> int:
    """A patch size as an int: the processor saves an int, the image processor a {"height", "width"} dict."""
    if isinstance(value, dict):
        if value.get("height") != value.get("width"):
            raise ValueError(f"mistral3: non-square patch size {value}")
        return int(value["height"])
    return int(value) if value is not None else default


def _settings(raw: dict[str, Any]) -> dict[str, Any]:
    """What Mistral 3 and Llava (Pixtral 12B) configs leave out, by their transformers defaults; Llava must hold a
    Pixtral tower and keep every patch (select strategy full)."""
    if raw.get("model_type") != "llava":
        return {"spatial_merge_size": int(raw.get("spatial_merge_size", 2)), "merger": True,
                "vision_feature_layer": raw.get("vision_feature_layer", -1),
                "bias": bool(raw.get("multimodal_projector_bias", False))}
    tower = (raw.get("vision_config") or {}).get("model_type", "pixtral")
    if tower != "pixtral":
        raise ValueError(f"llava: a {tower} vision tower is not supported (Pixtral's is)")
    if raw.get("vision_feature_select_strategy", "default") != "full":
        raise ValueError("llava: a Pixtral tower needs vision_feature_select_strategy full")
    return {"spatial_merge_size": 1, "merger": False, "vision_feature_layer": raw.get("vision_feature_layer", -2),
            "bias": bool(raw.get("multimodal_projector_bias", True))}


class PixtralProcessor:
    """`[IMG]` (the marker: what Mistral's chat templates write for an image part) -> rows x (cols x `[IMG]` +
    `[IMG_BREAK]`), the last `[IMG_BREAK]` replaced by `[IMG_END]`; rows and cols count patch x spatial_merge_size
    units of the resized image. All three are special tokens, so no merge crosses the run."""

    def __init__(self, raw: dict[str, Any], processor_config: dict[str, Any], tokenizer: Any) -> None:
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        self.image_marker_id = int(raw.get("image_token_index", raw.get("image_token_id", 10)))
        self.image_marker = tokenizer.decode([self.image_marker_id], skip_special_tokens=False)
        self.break_id = _token_id(tokenizer, processor_config.get("image_break_token", "[IMG_BREAK]"))
        self.end_id = _token_id(tokenizer, processor_config.get("image_end_token", "[IMG_END]"))
        merge = _settings(raw)["spatial_merge_size"]
        self.unit = int(vision["patch_size"]) * merge
        # The HF processor counts tokens with its own patch_size x spatial_merge_size: it must be the tower's.
        theirs = _patch(processor_config.get("patch_size"), int(vision["patch_size"]))
        theirs *= int(processor_config.get("spatial_merge_size", merge))
        if theirs != self.unit:
            raise ValueError(f"mistral3: the processor's patch x merge {theirs} != the tower's {self.unit}")
        size = processor_config.get("size") or {}
        self.longest_edge = int(size.get("longest_edge") or max(size.get("height", 0), size.get("width", 0)) or 1024)
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if not processor_config.get(flag, True):
                raise ValueError(f"mistral3: {flag} false is not supported")
        self.resample = resample_filter(processor_config, 3)  # bicubic
        self.normalize = PixelNormalizer.from_config(processor_config, CLIP_MEAN, CLIP_STD)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) as PixtralImageProcessorPil's get_resize_output_image_size: scaled down (floor) to fit the
        longest edge, then each edge up to whole units."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:  # NOTE: at least 1 px: a 2000 x 1 image floors to 0 rows, which transformers fails on
            height, width = max(1, int(math.floor(height / ratio))), max(1, int(math.floor(width / ratio)))
        u = self.unit
        return ((height - 1) // u + 1) * u, ((width - 1) // u + 1) * u

    def pixels(self, image: ImageInput) -> torch.Tensor:
        """(3, H, W) float32: PIL resize, x * rescale in float64 -> float32, then (x - mean) / std in float32."""
        height, width = self.resized_size(image.image.height, image.image.width)
        resized = image.image.resize((width, height), resample=self.resample)
        return torch.from_numpy(np.ascontiguousarray(self.normalize(resized)))

    def run(self, rows: int, cols: int) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        """One image's token ids and its embed runs (one per row)."""
        ids = ([self.image_marker_id] * cols + [self.break_id]) * rows
        ids[-1] = self.end_id
        return ids, tuple((r * (cols + 1), cols) for r in range(rows))

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence[ImageInput]) -> ExpandedPrompt:
        return ExpandedPrompt(*expand_markers(prompt_token_ids, self.image_marker_id, self.image_marker, images,
                                              self._image_run))

    def _image_run(self, image: ImageInput) -> ImageRun:
        pixels = self.pixels(image)
        rows, cols = pixels.shape[1] // self.unit, pixels.shape[2] // self.unit
        ids, runs = self.run(rows, cols)
        return ImageRun(ids, runs, pixels, {"rows": rows, "cols": cols})


def _token_id(tokenizer: Any, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"mistral3: the vocabulary has no {token}")
    return int(found)


def _mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight) if out is None else torch.mm(x, weight.t(), out=out)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' PixtralRMSNorm / Mistral3RMSNorm: fp32 statistics, weight x (normed in x's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PixtralLayer(nn.Module):
    """Pre-norm attention with 2D rotary q / k, then the gated MLP; q, k, v and gate, up each one GEMM."""

    def __init__(self, hidden: int, intermediate: int, heads: int, act: str, ops: KernelBackend | None) -> None:
        super().__init__()
        self.heads, self.intermediate = heads, intermediate
        self.ops = ops  # the engine's kernels (dense attention); None: plain torch
        self.attention_norm = nn.Parameter(torch.ones(hidden))
        self.ffn_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act, "mistral3")
        self.silu = act == "silu"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                buffers: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """(P, hidden) -> (P, hidden); cos, sin (P, head_dim) in x's dtype. `buffers` ("qkv" (P, 3 hidden), "gate_up"
        (P, 2 intermediate)): one encode's GEMM outputs, shared by its layers (same bits as fresh ones)."""
        rows, hidden = x.shape
        ops = self.ops
        h = ops.rms_norm(x, self.attention_norm, TOWER_EPS) if ops is not None else _rms_norm(
            x, self.attention_norm, TOWER_EPS)
        q, k, v = _mm(h, self.qkv.weight, buffers and buffers["qkv"]).split(hidden, dim=1)
        q, k = (self._rotate(t.reshape(rows, self.heads, -1), cos, sin).reshape(rows, hidden) for t in (q, k))
        attend = ops.dense_attention if ops is not None else reference_dense_attention
        delta = self.o_proj(attend(q, k, v, self.heads, (hidden // self.heads) ** -0.5))
        if ops is None:  # the fp32 path: transformers' ops exactly
            x = x + delta
            gate, up = self.gate_up(_rms_norm(x, self.ffn_norm, TOWER_EPS)).split(self.intermediate, dim=1)
            return x + self.down_proj(self.act(gate) * up)
        # the kernels: the residual add fused with the norm, silu(gate) * up in one pass (~25 ms a layer at 4k
        # patches), each rounding where torch's ops would
        x, h = ops.add_rms_norm(x, delta, self.ffn_norm, TOWER_EPS)
        gate_up = _mm(h, self.gate_up.weight, buffers and buffers["gate_up"])
        if self.silu:
            mixed = ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=1)
            mixed = self.act(gate) * up
        return x + self.down_proj(mixed)

    @staticmethod
    def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return (t * cos[:, None]) + (_rotate_half(t) * sin[:, None])  # (P, H, D), HF's order of operations


class Mistral3VisionEncoder(nn.Module):
    """PixtralVisionModel (patch conv, ln_pre, layers) up to vision_feature_layer + Mistral3MultiModalProjector
    (Llava's: no norm, no merger)."""

    def __init__(self, raw: dict[str, Any], ops: KernelBackend | None = None) -> None:
        super().__init__()
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        hidden, heads = int(vision["hidden_size"]), int(vision["num_attention_heads"])
        self.patch = int(vision["patch_size"])
        self.patch_conv = nn.Conv2d(int(vision["num_channels"]), hidden, self.patch, self.patch, bias=False)
        self.ln_pre = nn.Parameter(torch.ones(hidden))
        self.layers = nn.ModuleList(
            PixtralLayer(hidden, int(vision["intermediate_size"]), heads, str(vision["hidden_act"]), ops)
            for _ in range(int(vision["num_hidden_layers"])))
        rope = vision.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", vision.get("rope_theta", 10_000.0)))
        self.head_dim = hidden // heads
        # hidden_states[i] of HF's tower: 0 the embeddings, i after layer i; several are concatenated
        settings = _settings(raw)
        layer = settings["vision_feature_layer"]
        count = len(self.layers) + 1
        self.feature_layers = [i % count for i in (layer if isinstance(layer, list) else [layer])]
        text = raw["text_config"]
        self.merge = settings["spatial_merge_size"]
        self.norm_eps = float(text.get("rms_norm_eps", 1e-5))
        self.norm = nn.Parameter(torch.ones(hidden)) if settings["merger"] else None
        self.merging_layer = nn.Linear(hidden * self.merge ** 2, hidden, bias=False) if settings["merger"] else None
        bias = settings["bias"]
        width = hidden * len(self.feature_layers)
        self.linear_1 = nn.Linear(width, int(text["hidden_size"]), bias=bias)
        self.linear_2 = nn.Linear(int(text["hidden_size"]), int(text["hidden_size"]), bias=bias)
        self.projector_act = activation(str(raw.get("projector_hidden_act", "gelu")), "mistral3")
        if len(self.feature_layers) > 1:  # the projector norms and merges hidden-wide rows (HF does the same)
            raise ValueError("mistral3: several vision_feature_layer entries are not supported")

    def rotary(self, rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (rows x cols, head_dim): PixtralVisionRotaryEmbedding's axial angles, the even frequencies
        turned by the patch's row, the odd ones by its column, then the whole repeated (rotate-half layout)."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        h = torch.arange(rows, device=self.ln_pre.device).repeat_interleave(cols).float()
        w = torch.arange(cols, device=self.ln_pre.device).repeat(rows).float()
        inv_freq = inv_freq.to(self.ln_pre.device)
        angles = torch.cat([h[:, None] * inv_freq[0::2], w[:, None] * inv_freq[1::2]], dim=-1)  # (P, dim / 2)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @torch.inference_mode()
    def encode(self, item: ImageItem) -> torch.Tensor:
        """(rows x cols merged patches, text hidden) in the tower's dtype, row by row."""
        dtype = self.linear_2.weight.dtype
        x = self.patch_conv(item.pixel_values[None].to(self.ln_pre.device, dtype))[0]  # (hidden, h, w)
        hidden, h, w = x.shape
        # NOTE: contiguous rows: the conv's transposed strides would make every norm and residual add stride
        x = _rms_norm(x.flatten(1).transpose(0, 1).contiguous(), self.ln_pre, TOWER_EPS)  # (P, hidden)
        cos, sin = self.rotary(h, w, dtype)
        # NOTE: fresh (P, 2 intermediate) GEMM outputs cost page faults every layer (gate_up 56 -> 32 ms at 4k patches)
        buffers = None
        if self.layers and self.layers[0].ops is not None:
            rows, intermediate = x.shape[0], self.layers[0].intermediate
            buffers = {"qkv": x.new_empty(rows, 3 * hidden), "gate_up": x.new_empty(rows, 2 * intermediate)}
        for layer in self.layers[:self.feature_layers[0]]:
            x = layer(x, cos, sin, buffers)
        if self.merging_layer is not None:
            x = _rms_norm(x, self.norm, self.norm_eps)
            m = self.merge  # patch merger: each m x m block's features (channel-major, as F.unfold orders them)
            blocks = x.view(h // m, m, w // m, m, hidden).permute(0, 2, 4, 1, 3).reshape(-1, hidden * m * m)
            x = self.merging_layer(blocks)
        return self.linear_2(self.projector_act(self.linear_1(x)))

    def load(self, weights: dict[str, Any], dtype: torch.dtype) -> None:
        """HF names, either layout of TOWER_PREFIXES / PROJECTOR_PREFIXES."""
        tower = find_prefix(weights, TOWER_PREFIXES, "patch_conv.weight", "mistral3")
        projector = find_prefix(weights, PROJECTOR_PREFIXES, "linear_1.weight", "mistral3")
        names: Names = {"patch_conv.weight": tower + "patch_conv.weight", "ln_pre": tower + "ln_pre.weight"}
        if self.merging_layer is not None:
            names["norm"] = projector + "norm.weight"
            names["merging_layer.weight"] = projector + "patch_merger.merging_layer.weight"
        for name in ("linear_1", "linear_2"):
            names[f"{name}.weight"] = f"{projector}{name}.weight"
            if getattr(self, name).bias is not None:
                names[f"{name}.bias"] = f"{projector}{name}.bias"
        for i in range(len(self.layers)):
            theirs, ours = f"{tower}transformer.layers.{i}.", f"layers.{i}."
            names[ours + "attention_norm"] = theirs + "attention_norm.weight"
            names[ours + "ffn_norm"] = theirs + "ffn_norm.weight"
            names[ours + "qkv.weight"] = tuple(f"{theirs}attention.{p}_proj.weight" for p in "qkv")
            names[ours + "o_proj.weight"] = theirs + "attention.o_proj.weight"
            names[ours + "gate_up.weight"] = tuple(f"{theirs}feed_forward.{p}_proj.weight" for p in ("gate", "up"))
            names[ours + "down_proj.weight"] = theirs + "feed_forward.down_proj.weight"
        load_renamed(self, weights, names, dtype, "mistral3")


def build_vision(checkpoint: VisionCheckpoint, tokenizer: Any, dtype: torch.dtype, device: torch.device,
                 ops: KernelBackend | None = None) -> VisionModel:
    encoder = Mistral3VisionEncoder(checkpoint.config, ops)
    encoder.load(checkpoint.weights, dtype)
    return VisionModel(PixtralProcessor(checkpoint.config, checkpoint.processor_config, tokenizer),
                       encoder.to(device), checkpoint.model_type)
