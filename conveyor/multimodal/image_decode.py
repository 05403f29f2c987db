"""Image bytes -> ImageInput, checked: one still picture of an allowed format, within the pixel limit.

Every failure is an InvalidRequestError (a 400) that says what was wrong; nothing here may crash the server
whatever the bytes. The pixel limit is checked on the header's size before any pixel is decoded, so a
decompression bomb (a small file of a huge image) costs a header parse. Call it off the event loop: a large
JPEG takes tens of milliseconds to decode.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_input import ImageInput

# What OpenAI and Anthropic accept (png, jpeg, webp, gif) plus BMP, which llama.cpp reads too. Pillow tries
# only these decoders, so bytes of another format never reach a rarely used parser.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Modes whose alpha is composited onto white, as transformers' convert_to_rgb (and vLLM) do.
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def decode_image(data: bytes, max_pixels: int, what: str = "image", param: str | None = None) -> ImageInput:
    """`what` names the image in messages ("image 2"); `param` is the request field the 400 names."""
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except UnidentifiedImageError:
        raise InvalidRequestError(f"{what}: {_unreadable(data)}", param) from None
    except Image.DecompressionBombError as exc:  # Pillow's own bound (~179M pixels) caps --max-image-pixels
        raise InvalidRequestError(f"{what} has too many pixels: {exc}", param) from None
    except Exception as exc:  # a header a decoder chokes on: never a 500
        raise InvalidRequestError(f"{what} is corrupt: {exc}", param) from None
    with image:
        width, height = image.size
        if width * height > max_pixels:
            raise InvalidRequestError(f"{what} is {width}x{height} = {width * height} pixels; at most {max_pixels} "
                                      "are allowed (--max-image-pixels)", param)
        # NOTE: peers differ here (vLLM and llama.cpp take the first frame); OpenAI documents non-animated GIFs
        # only, and a silent first frame could answer about a picture the user did not mean.
        if getattr(image, "is_animated", False):
            raise InvalidRequestError(f"{what} is animated ({image.format} with several frames): send one frame as "
                                      "a still image", param)
        try:
            image.load()
            rgb = _to_rgb(image)
        except Exception as exc:  # truncated file, broken stream, bad palette...
            raise InvalidRequestError(f"{what} is corrupt or truncated ({image.format}): {exc}", param) from None
    return ImageInput.from_pil(rgb)


def _unreadable(data: bytes) -> str:
    """Why Pillow found no allowed decoder: another image format (named), or not an image at all."""
    if not data:
        return "the image data is empty"
    try:  # identify only (header parse, no pixels), to name the format in the 400
        with Image.open(io.BytesIO(data)) as other:
            kind = other.format
    except Exception:
        return "the data is not an image (or is corrupt)"
    return f"unsupported image format {kind} (allowed: {', '.join(ALLOWED_FORMATS)})"


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image.copy()
    transparent = image.mode in _ALPHA_MODES or (image.mode == "P" and "transparency" in image.info)
    if not transparent:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
