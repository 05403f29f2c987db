"""Image files for the image-input tests: good ones in each format, and the bad ones each check must refuse."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def picture(seed: int, size: tuple[int, int] = (40, 30), mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    return Image.fromarray(pixels if len(mode) > 1 else pixels[..., 0], mode)


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png(seed: int = 0, size: tuple[int, int] = (40, 30)) -> bytes:
    return encoded(picture(seed, size))


def animated_gif() -> bytes:
    frames = [picture(s, (16, 16)).convert("P") for s in range(2)]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over one empty IDAT: a decompression bomb's shape, in 60 bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
