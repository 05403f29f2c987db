"""Vision-tower outputs by image content hash, least recently used first out.

16 requests about one image encode it once; a request whose image was evicted before its prefill reached it is
encoded again, which gives the same rows (each image is encoded alone), so eviction never changes an output.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from conveyor.multimodal.vision import ImageItem, VisionEncoder

DEFAULT_MAX_BYTES = 256 * 2**20  # ~128 Gemma 3 4B images (256 x 2560 bf16)


class EncoderCache:
    def __init__(self, encoder: VisionEncoder, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.encoder = encoder
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.num_encoded = 0  # images run through the tower (misses)
        self.num_hits = 0

    def get(self, item: ImageItem) -> torch.Tensor:
        """(item.num_embeds, text hidden): the item's embeddings, encoded on a miss."""
        rows = self._rows.get(item.content_hash)
        if rows is not None:
            self._rows.move_to_end(item.content_hash)
            self.num_hits += 1
            return rows
        rows = self.encoder.encode(item)
        if rows.shape[0] != item.num_embeds:
            raise ValueError(f"vision encoder gave {rows.shape[0]} rows for an image of {item.num_embeds} embeds")
        self.num_encoded += 1
        self._rows[item.content_hash] = rows
        self._bytes += rows.numel() * rows.element_size()
        while self._bytes > self.max_bytes and len(self._rows) > 1:
            _, old = self._rows.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        return rows

    def __len__(self) -> int:
        return len(self._rows)
