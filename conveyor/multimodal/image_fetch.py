"""An API's image reference (a URL, or base64 with its media type) -> checked ImageInput.

    data:image/png;base64,...   always (the bytes are in the request)
    http(s)://host/...          only with --allow-remote-images (any host) or --allowed-media-domains (those hosts);
                                no redirects (one could lead past the domain list), a timeout and a byte limit
    file:///path                only under --allowed-local-media-path DIR (symlinks resolved first)

Every refusal is an InvalidRequestError (a 400) naming the image. Base64, file reads and decoding run in a
worker thread, so a large image never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httpx

from conveyor.config import ServerConfig
from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_decode import decode_image
from conveyor.multimodal.image_input import ImageInput


@dataclass(frozen=True)
class ImagePolicy:
    """What a request's images may be and where they may come from (ServerConfig's image flags)."""

    max_images: int = 8  # per request, all turns together
    max_image_bytes: int = 20 << 20  # encoded bytes of one image (after base64, or as fetched)
    max_image_pixels: int = 40_000_000  # width x height of one image, checked before decoding
    fetch_timeout_s: float = 10.0  # a whole http(s) fetch, connect to last byte
    allow_remote: bool = False  # http(s) from any host
    allowed_domains: tuple[str, ...] = ()  # http(s) from these hosts only (exact host names)
    local_media_path: str | None = None  # file:// URLs under this directory

    @classmethod
    def from_config(cls, config: ServerConfig) -> ImagePolicy:
        domains = tuple(d.strip().lower() for d in (config.allowed_media_domains or "").split(",") if d.strip())
        return cls(config.max_images, config.max_image_bytes, config.max_image_pixels, config.image_fetch_timeout,
                   config.allow_remote_images, domains, config.allowed_local_media_path)

    @property
    def fetches_remote(self) -> bool:
        return self.allow_remote or bool(self.allowed_domains)


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: a URL (data:, http(s):, file:) or raw base64 (Anthropic's source)."""

    url: str | None = None
    base64_data: str | None = None
    what: str = "image"  # how messages name it: "image 2"
    param: str | None = None  # the request field a 400 names


async def load_image(ref: ImageRef, policy: ImagePolicy, client: httpx.AsyncClient | None = None) -> ImageInput:
    try:
        return await _load(ref, policy, client)
    except InvalidRequestError:
        raise
    except (ValueError, httpx.InvalidURL) as exc:  # a URL urllib or httpx cannot parse ("http://[::1/a")
        raise _refused(ref, f"the image URL is not valid: {exc}") from None


async def _load(ref: ImageRef, policy: ImagePolicy, client: httpx.AsyncClient | None) -> ImageInput:
    if ref.base64_data is not None:
        return await asyncio.to_thread(_from_base64, ref.base64_data, ref, policy)
    url = ref.url or ""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return await asyncio.to_thread(_from_data_url, url, ref, policy)
    if scheme in ("http", "https"):
        data = await _fetch(url, ref, policy, client)
        return await asyncio.to_thread(decode_image, data, policy.max_image_pixels, ref.what, ref.param)
    if scheme == "file":
        return await asyncio.to_thread(_from_file, url, ref, policy)
    what = f"URL scheme {scheme} is not supported" if scheme else "the image URL has no scheme"
    raise _refused(ref, f"{what} (give a data: URL with base64 image bytes, or an http(s) / file URL where the "
                        "server allows them)")


def _refused(ref: ImageRef, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"{ref.what}: {reason}", ref.param)


def _from_data_url(url: str, ref: ImageRef, policy: ImagePolicy) -> ImageInput:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise _refused(ref, "a data URL must hold base64 image bytes (data:image/png;base64,...)")
    return _from_base64(payload, ref, policy)


def _from_base64(payload: str, ref: ImageRef, policy: ImagePolicy) -> ImageInput:
    if len(payload) // 4 * 3 > policy.max_image_bytes + 2:  # before decoding anything
        raise _too_big(ref, len(payload) // 4 * 3, policy)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        data = _wrapped_base64(payload)
        if data is None:
            raise _refused(ref, "the base64 image data is not valid base64") from None
    if len(data) > policy.max_image_bytes:
        raise _too_big(ref, len(data), policy)
    return decode_image(data, policy.max_image_pixels, ref.what, ref.param)


def _wrapped_base64(payload: str) -> bytes | None:
    """Base64 wrapped in lines (MIME's 76 columns, Python's encodebytes) decodes too; anything else is None."""
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def _too_big(ref: ImageRef, size: int, policy: ImagePolicy) -> InvalidRequestError:
    return _refused(ref, f"{size} bytes is larger than the {policy.max_image_bytes} bytes allowed per image "
                         "(--max-image-bytes)")


def _from_file(url: str, ref: ImageRef, policy: ImagePolicy) -> ImageInput:
    if policy.local_media_path is None:
        raise _refused(ref, "file:// URLs are not allowed (the server has no --allowed-local-media-path)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _refused(ref, f"file URL host {parts.netloc!r} is not this machine")
    root = os.path.realpath(policy.local_media_path)
    path = os.path.realpath(unquote(parts.path))
    if os.path.commonpath([root, path]) != root:
        raise _refused(ref, "the file is outside the server's --allowed-local-media-path")
    try:
        with open(path, "rb") as f:
            data = f.read(policy.max_image_bytes + 1)
    except OSError as exc:
        raise _refused(ref, f"cannot read the file: {exc.strerror or exc}") from None
    if len(data) > policy.max_image_bytes:
        raise _too_big(ref, len(data), policy)
    return decode_image(data, policy.max_image_pixels, ref.what, ref.param)


async def _fetch(url: str, ref: ImageRef, policy: ImagePolicy, client: httpx.AsyncClient | None) -> bytes:
    if not policy.fetches_remote:
        raise _refused(ref, "http(s) image URLs are not allowed on this server (--allow-remote-images or "
                            "--allowed-media-domains); send the image as a data: URL")
    host = (urlsplit(url).hostname or "").lower()
    if not host:
        raise _refused(ref, "the image URL has no host")
    if policy.allowed_domains and host not in policy.allowed_domains:
        raise _refused(ref, f"host {host!r} is not in the server's --allowed-media-domains")
    try:
        return await asyncio.wait_for(_download(url, ref, policy, client), policy.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise _refused(ref, f"fetching {url[:200]} took longer than {policy.fetch_timeout_s:g} s "
                            "(--image-fetch-timeout)") from None
    except httpx.HTTPError as exc:
        raise _refused(ref, f"fetching {url[:200]} failed: {exc}") from None


async def _download(url: str, ref: ImageRef, policy: ImagePolicy, client: httpx.AsyncClient | None) -> bytes:
    owned = client is None
    client = client or httpx.AsyncClient(follow_redirects=False)
    try:
        async with client.stream("GET", url, timeout=policy.fetch_timeout_s, follow_redirects=False) as response:
            if response.status_code != 200:
                raise _refused(ref, f"fetching {url[:200]} failed: HTTP {response.status_code}"
                                    + (" (redirects are not followed)" if response.is_redirect else ""))
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > policy.max_image_bytes:  # stop reading: a huge (or endless) body costs the limit
                    raise _too_big(ref, size, policy)
                chunks.append(chunk)
            return b"".join(chunks)
    finally:
        if owned:
            await client.aclose()
