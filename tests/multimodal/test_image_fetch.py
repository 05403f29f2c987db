"""image_decode.py and image_fetch.py without a server: every source and every refusal (milliseconds each; the
http cases on a local server)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time

import pytest
from PIL import Image

from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_decode import decode_image
from conveyor.multimodal.image_fetch import ImagePolicy, ImageRef, load_image
from conveyor.multimodal.image_input import ImageInput
from tests.multimodal.image_files import animated_gif, data_url, encoded, picture, png, png_header_only

MAX_PIXELS = 10_000


def _load(url: str | None = None, policy: ImagePolicy = ImagePolicy(), base64_data: str | None = None) -> ImageInput:
    return asyncio.run(load_image(ImageRef(url=url, base64_data=base64_data, what="image 1", param="p"), policy))


def _refused(match: str, url: str | None = None, policy: ImagePolicy = ImagePolicy(), **kwargs) -> None:
    with pytest.raises(InvalidRequestError, match=match) as caught:
        _load(url, policy, **kwargs)
    assert caught.value.param == "p" and str(caught.value).startswith("image 1")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_each_allowed_format_decodes_to_rgb(fmt):
    image = decode_image(encoded(picture(1), fmt), MAX_PIXELS)
    assert image.image.mode == "RGB" and image.size == (40, 30)


def test_lossless_pixels_keep_their_hash_whatever_the_container():
    rgb = picture(2)
    hashes = {decode_image(encoded(rgb, fmt), MAX_PIXELS).content_hash for fmt in ("PNG", "BMP", "WEBP")
              if fmt != "WEBP"} | {decode_image(encoded(rgb, "WEBP", lossless=True), MAX_PIXELS).content_hash}
    assert hashes == {ImageInput.from_pil(rgb).content_hash}


def test_transparent_pixels_are_composited_on_white():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert decode_image(encoded(rgba), MAX_PIXELS).image.getpixel((0, 0)) == (255, 255, 255)
    gray = decode_image(encoded(picture(3, mode="L")), MAX_PIXELS).image
    assert gray.mode == "RGB"


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"hello, this is text", "not an image"),
    (encoded(picture(1), "TIFF"), "unsupported image format TIFF"),
    (png()[:200], "corrupt or truncated"),
    (animated_gif(), "animated"),
    (png(size=(200, 100)), "20000 pixels; at most 10000"),
    (png_header_only(100_000, 100_000), "too many pixels: Image size"),  # Pillow's own bomb check first
    (png_header_only(120, 100), "12000 pixels"),  # under Pillow's limit, over ours: refused before decoding
])
def test_bad_bytes_are_refused_with_the_reason(data, match):
    with pytest.raises(InvalidRequestError, match=match):
        decode_image(data, MAX_PIXELS, "image 3", "p")


def test_data_urls_and_raw_base64():
    url = data_url(png(4))
    assert _load(url).content_hash == ImageInput.from_pil(picture(4)).content_hash
    assert _load(base64_data=url.split(",", 1)[1]).size == (40, 30)
    _refused("not valid base64", "data:image/png;base64,@@@@")
    wrapped = base64.encodebytes(png(4)).decode()  # lines of 76 columns
    assert _load(f"data:image/png;base64,{wrapped}").content_hash == ImageInput.from_pil(picture(4)).content_hash
    _refused("has no scheme", url.split(",", 1)[1])
    _refused("must hold base64", "data:image/png,abc")
    _refused("--max-image-bytes", url, ImagePolicy(max_image_bytes=100))
    _refused("--max-image-bytes", None, ImagePolicy(max_image_bytes=100), base64_data=url.split(",", 1)[1])


def test_schemes_off_by_default():
    _refused("scheme ftp is not supported", "ftp://example.com/a.png")
    _refused("http\\(s\\) image URLs are not allowed", "https://example.com/a.png")
    _refused("file:// URLs are not allowed", "file:///etc/hostname")


def test_file_urls_only_under_the_allowed_directory(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png(5))
    (tmp_path / "secret.png").write_bytes(png(6))
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    policy = ImagePolicy(local_media_path=str(inside))
    assert _load(f"file://{inside}/a.png", policy).size == (40, 30)
    _refused("outside", f"file://{tmp_path}/secret.png", policy)
    _refused("outside", f"file://{inside}/../secret.png", policy)
    _refused("outside", f"file://{inside}/link.png", policy)  # a symlink out is resolved first
    _refused("cannot read", f"file://{inside}/absent.png", policy)
    _refused("not this machine", f"file://otherhost{inside}/a.png", policy)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        body = png(7) if self.path in ("/a.png", "/slow.png") else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass  # the client stopped reading (the byte limit, or its timeout)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_fetch_with_domains_timeout_and_limits(image_server):
    policy = ImagePolicy(allowed_domains=("127.0.0.1",), fetch_timeout_s=1.0)
    assert _load(f"{image_server}/a.png", policy).content_hash == ImageInput.from_pil(picture(7)).content_hash
    _refused("HTTP 404", f"{image_server}/absent.png", policy)
    _refused("redirects are not followed", f"{image_server}/moved.png", policy)
    _refused("took longer than 1 s", f"{image_server}/slow.png", policy)
    _refused("--max-image-bytes", f"{image_server}/a.png", ImagePolicy(allow_remote=True, max_image_bytes=100))
    _refused("not in the server's --allowed-media-domains", f"{image_server}/a.png",
             ImagePolicy(allowed_domains=("example.com",)))
    _refused("failed", "http://127.0.0.1:1/a.png", ImagePolicy(allow_remote=True))  # nothing listens on port 1
    _refused("not valid", "http://[::1/a.png", ImagePolicy(allow_remote=True))
    _refused("not valid", "file://[x/a.png", ImagePolicy(local_media_path="/tmp"))


def test_decoding_runs_off_the_event_loop_thread(monkeypatch):
    import conveyor.multimodal.image_fetch as image_fetch

    threads = []

    def decode(*args, **kwargs):
        threads.append(threading.get_ident())
        return decode_image(*args, **kwargs)
    monkeypatch.setattr(image_fetch, "decode_image", decode)
    _load(data_url(png(8)))
    assert threads and threads[0] != threading.get_ident()
