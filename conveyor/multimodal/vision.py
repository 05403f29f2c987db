"""The contract between a vision family and the engine (docs/vision.md).

A family supplies two things, built from the checkpoint by its loader (register_vision):

  VisionProcessor (pure Python / PIL / torch, no weights): the prompt's token ids, holding one marker token per
  image (what the chat template writes for an image part, e.g. Gemma 3's `<start_of_image>`), plus the images ->
  the expanded ids (each marker replaced by the image's whole token run, exactly as the HF processor does) and one
  ImageItem per image.
  VisionEncoder (nn.Module: tower + projector): one ImageItem -> its embeddings (num_embeds, text hidden), which
  replace the token embeddings at the item's embed rows.

The engine does the rest: a Request carries its items, its prefix-cache block keys fold in the content hash of
every image a block overlaps (engine/block_keys.py), the scheduler never ends a prefill chunk inside a
bidirectional span, and the runner encodes each image once (an LRU keyed by content hash) and substitutes rows.

    prompt ids   ... <start_of_turn>user\\n <boi> Describe ...
    expanded     ... <start_of_turn>user\\n\\n\\n <boi> <img> x N <eoi> \\n\\n Describe ...
                                           |<------- ImageItem span ------->|
                                           offset        embed_runs = ((2, N),)  (relative to offset)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from conveyor.multimodal.image_input import ImageInput

if TYPE_CHECKING:
    from conveyor.kernels import KernelBackend


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of one request, placed in its (expanded) prompt. Opaque to the scheduler but for the positions."""

    content_hash: str  # ImageInput.content_hash: the prefix-cache and encoder-cache identity
    offset: int  # prompt position of the span's first token (markers included)
    num_tokens: int  # the span's length: every token this image expanded to
    # (start relative to offset, length) of the rows that take the encoder's output, in its row order (one run for
    # Gemma 3 / Qwen-VL; one per tile for Idefics3's split images, whose tile markers stay token embeddings)
    embed_runs: tuple[tuple[int, int], ...]
    pixel_values: torch.Tensor  # whatever the family's encoder takes (Gemma 3: (3, H, W) float32)
    # The rows of each embed run attend to each other both ways (Gemma 3's token_type_ids mask): the scheduler keeps
    # a run in one chunk and the runner extends those rows' causal limit to the run's end.
    bidirectional: bool = False
    extras: dict[str, Any] = field(default_factory=dict)  # family data (Qwen-VL's grid_thw, ...)
    # The tower's output, when it came with the item instead of pixels (a handed-off image on a decode node:
    # cluster/images.py); the encoder cache returns it as it is and never encodes such an item.
    embeds: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def num_embeds(self) -> int:
        return sum(n for _, n in self.embed_runs)

    def embed_positions(self) -> list[int]:
        """Absolute prompt positions of the embed rows, in the encoder output's row order."""
        return [self.offset + start + i for start, n in self.embed_runs for i in range(n)]

    def bidirectional_runs(self) -> list[tuple[int, int]]:
        """Absolute [start, end) of the runs a prefill chunk must not end inside (none unless bidirectional)."""
        if not self.bidirectional:
            return []
        return [(self.offset + start, self.offset + start + n) for start, n in self.embed_runs]


@dataclass(frozen=True)
class ExpandedPrompt:
    token_ids: list[int]
    items: list[ImageItem]  # in prompt order, non-overlapping
    # Multimodal rotary (Qwen-VL's mrope): the prompt's (t, h, w) rotary positions, three lists of len(token_ids),
    # and what a later row's position adds on every axis (its sequence position + delta). None: plain positions.
    rope_positions: tuple[list[int], list[int], list[int]] | None = None
    rope_delta: int = 0


class VisionProcessor(Protocol):
    """Marker ids + images -> the prompt the model sees. Raises InvalidRequestError (a 400) on a marker count that
    does not match the images."""

    # The token the chat template writes for one image part (the API layer may also insert it by id).
    image_marker_id: int
    image_marker: str

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence[ImageInput]) -> ExpandedPrompt: ...


class VisionEncoder(Protocol):
    """Tower + projector. encode() sees one image at a time, so its rows never depend on batch-mates."""

    def encode(self, item: ImageItem) -> torch.Tensor: ...  # (item.num_embeds, text hidden), the model's dtype


@dataclass
class VisionModel:
    processor: VisionProcessor
    encoder: VisionEncoder
    model_type: str  # the multimodal checkpoint's model_type ("gemma3", ...)
    # Qwen3-VL: each encoder row carries this many DeepStack levels beside its main part, side by side along the
    # hidden dim (models/qwen3_vl.py adds them after the first decoder layers); 0 elsewhere.
    num_levels: int = 0

    def row_width(self, hidden: int) -> int:
        """The width of the encoder's rows for a text model `hidden` wide (what a KV handoff carries)."""
        return hidden * (1 + self.num_levels)


@dataclass
class VisionCheckpoint:
    """What a loader keeps of a multimodal checkpoint beyond its text model."""

    model_type: str
    config: dict[str, Any]  # the whole config.json (vision_config, token ids, mm_tokens_per_image, ...)
    processor_config: dict[str, Any]  # preprocessor_config.json / processor_config.json merged ({} if none)
    weights: dict[str, Any]  # the checkpoint's tensors under their HF names (the family picks its own)


# model_type -> "module:function(checkpoint: VisionCheckpoint, tokenizer, dtype, device, ops) -> VisionModel"
# (ops: the engine's KernelBackend, or None: plain torch)
_BUILDERS: dict[str, str] = {
    "gemma3": "conveyor.multimodal.gemma3:build_vision",
    "idefics3": "conveyor.multimodal.idefics3:build_vision",
    "smolvlm": "conveyor.multimodal.idefics3:build_vision",
    "mistral3": "conveyor.multimodal.pixtral:build_vision",
    "llava": "conveyor.multimodal.pixtral:build_vision",  # Pixtral 12B (other Llava towers: a load error)
    "qwen3_5": "conveyor.multimodal.qwen3_vl:build_vision",
    "qwen3_5_moe": "conveyor.multimodal.qwen3_vl:build_vision",
    "qwen3_vl": "conveyor.multimodal.qwen3_vl:build_vision",
    "qwen3_vl_moe": "conveyor.multimodal.qwen3_vl:build_vision",
    "lfm2_vl": "conveyor.multimodal.lfm2_vl:build_vision",
}


def register_vision(model_type: str, builder: str) -> None:
    _BUILDERS[model_type] = builder


def vision_model_types() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def build_vision(checkpoint: VisionCheckpoint, tokenizer: Any, dtype: torch.dtype, device: torch.device,
                 ops: KernelBackend | None = None) -> VisionModel | None:
    """The family's processor and encoder, or None for a model_type without a vision family. `ops` (the engine's
    KernelBackend) gives the tower our kernels (dense attention); None runs it in plain torch."""
    target = _BUILDERS.get(checkpoint.model_type)
    if target is None:
        return None
    module, name = target.split(":")
    builder: Callable[..., VisionModel] = getattr(importlib.import_module(module), name)
    return builder(checkpoint, tokenizer, dtype, device, ops=ops)


def key_spans(items: Sequence[ImageItem]) -> list[tuple[int, int, bytes]]:
    """(start, end, hash bytes) per image: what a prefix block overlapping [start, end) folds into its key."""
    return [(item.offset, item.end, bytes.fromhex(item.content_hash)) for item in items]
