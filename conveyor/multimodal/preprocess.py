"""What the vision families' processors and towers share: expand()'s marker walk and its marker-count check, PIL
resize filters, transformers' PIL rescale + normalize, cached text pieces, and the activations a config may name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.nn import functional as F

from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.vision import ImageItem

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / _STD: Pixtral's and Qwen-VL's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN / _STD: SigLIP's (Gemma 3, Idefics3)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str, family: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"{family}: activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def check_marker_count(prompt_token_ids: Sequence[int], marker_id: int, marker: str,
                       images: Sequence[ImageInput]) -> None:
    """One image per marker token, else a 400 (the chat template writes one marker per image part)."""
    markers = sum(1 for t in prompt_token_ids if t == marker_id)
    if markers != len(images):
        raise InvalidRequestError(f"the prompt has {markers} image markers ({marker}) for {len(images)} images",
                                  "messages")


@dataclass(frozen=True)
class ImageRun:
    """What one image's marker expands to: the token ids, the embed runs among them (relative to the first), the
    encoder's input and the family's extras (ImageItem's fields but the placement)."""

    token_ids: Sequence[int]
    embed_runs: tuple[tuple[int, int], ...]
    pixel_values: torch.Tensor
    extras: dict[str, Any]


def expand_markers(prompt_token_ids: Sequence[int], marker_id: int, marker: str, images: Sequence[ImageInput],
                   image_run: Callable[[ImageInput], ImageRun]) -> tuple[list[int], list[ImageItem]]:
    """The expanded ids and one ImageItem per image: each marker token replaced by its image's run, in order
    (a marker count other than the image count is a 400)."""
    check_marker_count(prompt_token_ids, marker_id, marker, images)
    out: list[int] = []
    items: list[ImageItem] = []
    pending = iter(images)
    for token in prompt_token_ids:
        if token != marker_id:
            out.append(token)
            continue
        image = next(pending)
        run = image_run(image)
        items.append(ImageItem(image.content_hash, len(out), len(run.token_ids), run.embed_runs, run.pixel_values,
                               extras=run.extras))
        out += run.token_ids
    return out, items


def resample_filter(processor_config: dict[str, Any], default: int) -> Image.Resampling:
    """The config's `resample` (PIL's numbering, as transformers' PILImageResampling) as a PIL filter."""
    value = processor_config.get("resample", default)
    if not (isinstance(value, int) and 0 <= value <= 5):  # PILImageResampling's range
        raise ValueError(f"image processor resample {value!r} is not one of PIL's filters (0-5)")
    return Image.Resampling(value)


class TextPieces:
    """Token ids of the short texts an image run is built from (tile headers, start / end markers), each tokenized
    alone and once: every piece starts and ends at a special token, so no merge crosses into its neighbours.
    Tuples: a caller extends its run from them and can never change the cached ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[str, tuple[int, ...]] = {}

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return ids


@dataclass(frozen=True)
class PixelNormalizer:
    """x * rescale in float64 -> float32, then (x - mean) / std in float32: the order transformers' PIL image
    processors round in (each step a numpy op on the whole image), so the pixels match theirs bitwise."""

    rescale: float
    mean: np.ndarray  # (3,) float32
    std: np.ndarray  # (3,) float32

    @classmethod
    def from_config(cls, processor_config: dict[str, Any], mean: Sequence[float],
                    std: Sequence[float]) -> PixelNormalizer:
        """The config's rescale_factor, image_mean and image_std; `mean` and `std` where it names none."""
        return cls(float(processor_config.get("rescale_factor", 1 / 255)),
                   np.array(processor_config.get("image_mean", mean), dtype=np.float32),
                   np.array(processor_config.get("image_std", std), dtype=np.float32))

    def __call__(self, image: Image.Image) -> np.ndarray:
        """An RGB image -> (3, H, W) float32 (a transposed view: make it contiguous before torch takes it)."""
        x = (np.asarray(image).astype(np.float64) * self.rescale).astype(np.float32)  # (H, W, 3)
        return ((x - self.mean) / self.std).transpose(2, 0, 1)
