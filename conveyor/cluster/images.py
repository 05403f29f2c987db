"""Images across the cluster, both hops:

    router ──GenerateFrame.images (ImageWire: RGB rows)──> prefill: hashes them, runs its processor and tower
    prefill ──HandoffFrame.images (ImageSpanWire: place, hash, tower rows)──> decode: never sees a pixel

The router decodes and checks each image part with a node's own code and limits (server/chat_images.py), so a bad
image is the same 400 before anything is dispatched. The decode node gets each image's span in the expanded prompt
(its block keys fold the hash, as on the prefill node) and the tower's output rows, which it needs only when it
re-prefills the sequence itself (no free block at arrival, a preemption): the same rows, so the same bits.
Every conversion from the wire raises ValueError on a malformed value (the node answers 400).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from PIL import Image

from conveyor.cluster.wire import ImageSpanWire, ImageWire
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.vision import ImageItem

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_HASH = re.compile(r"[0-9a-f]{2,128}")


def images_to_wire(images: Sequence[ImageInput]) -> list[ImageWire]:
    return [ImageWire(width=image.size[0], height=image.size[1], rgb=image.image.tobytes()) for image in images]


def images_from_wire(images: Sequence[ImageWire]) -> list[ImageInput]:
    """The prefill node's ImageInputs, hashed here (a cache key is never taken from the wire). Worker thread."""
    out = []
    for i, image in enumerate(images):
        if image.width < 1 or image.height < 1 or len(image.rgb) != image.width * image.height * 3:
            raise ValueError(f"image {i + 1}: {len(image.rgb)} bytes are not {image.width} x {image.height} RGB")
        out.append(ImageInput.from_pil(Image.frombytes("RGB", (image.width, image.height), image.rgb)))
    return out


def spans_to_wire(items: Sequence[ImageItem], rows: Sequence[torch.Tensor]) -> list[ImageSpanWire]:
    spans = []
    for item, embeds in zip(items, rows, strict=True):
        embeds = embeds.detach().contiguous().cpu()  # (num_embeds, hidden)
        dtype = next(name for name, d in _DTYPES.items() if d == embeds.dtype)
        spans.append(ImageSpanWire(content_hash=item.content_hash, offset=item.offset, num_tokens=item.num_tokens,
                                   embed_runs=[tuple(run) for run in item.embed_runs],
                                   rows=embeds.view(torch.uint8).numpy().tobytes(), dtype=dtype,
                                   hidden=embeds.shape[1], bidirectional=item.bidirectional))
    return spans


def spans_from_wire(spans: Sequence[ImageSpanWire], num_prompt_tokens: int, hidden: int, dtype: torch.dtype,
                    device: torch.device | str) -> list[ImageItem]:
    """The decode node's ImageItems: placed in the prompt, in order, with their rows in this node's shape and dtype."""
    items, end = [], 0
    for i, span in enumerate(spans):
        what = f"image {i + 1}"
        if not _HASH.fullmatch(span.content_hash):
            raise ValueError(f"{what}: content hash {span.content_hash!r} is not hex")
        if span.offset < end or span.num_tokens < 1 or span.offset + span.num_tokens > num_prompt_tokens:
            raise ValueError(f"{what}: span [{span.offset}, {span.offset + span.num_tokens}) is not inside the prompt "
                             f"({num_prompt_tokens} tokens) after the previous image")
        if not span.embed_runs or any(s < 0 or n < 1 or s + n > span.num_tokens for s, n in span.embed_runs):
            raise ValueError(f"{what}: embed runs {span.embed_runs} do not fit its {span.num_tokens} tokens")
        if _DTYPES.get(span.dtype) != dtype or span.hidden != hidden:
            raise ValueError(f"{what}: rows of {span.hidden} x {span.dtype} do not match this node's {hidden} x "
                             f"{str(dtype).removeprefix('torch.')}")
        num_embeds = sum(n for _, n in span.embed_runs)
        if len(span.rows) != num_embeds * hidden * dtype.itemsize:
            raise ValueError(f"{what}: {len(span.rows)} bytes of rows, expected {num_embeds} x {hidden}")
        embeds = torch.frombuffer(bytearray(span.rows), dtype=torch.uint8).view(dtype).view(num_embeds, hidden)
        items.append(ImageItem(span.content_hash, span.offset, span.num_tokens,
                               tuple((s, n) for s, n in span.embed_runs), pixel_values=None,  # never encoded here
                               bidirectional=span.bidirectional, embeds=embeds.to(device)))
        end = span.offset + span.num_tokens
    return items


def rope_from_wire(positions: list[list[int]] | None,
                   num_prompt_tokens: int) -> tuple[list[int], list[int], list[int]] | None:
    if positions is None:
        return None
    if len(positions) != 3 or any(len(axis) != num_prompt_tokens for axis in positions):
        raise ValueError(f"rope_positions must be 3 lists of {num_prompt_tokens} positions (t, h, w)")
    return positions[0], positions[1], positions[2]
