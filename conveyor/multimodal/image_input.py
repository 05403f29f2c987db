"""One image of a request, decoded and checked: what the API layer hands to the engine.

The content hash names the pixels (not the file's bytes), so the same picture sent as PNG or as a
re-encoded data URL shares one prefix-cache entry and one vision-tower output.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from PIL import Image


@dataclass(frozen=True)
class ImageInput:
    image: Image.Image  # RGB, one frame, already checked against the size limits
    content_hash: str   # hex blake2b-128 of (width, height, RGB bytes): the image's identity in every cache

    @classmethod
    def from_pil(cls, image: Image.Image) -> ImageInput:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        return cls(rgb, pixel_hash(rgb))

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def pixel_hash(rgb: Image.Image) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()
