"""The built-in page at `/`: chat and a live dashboard, plain HTML/CSS/JS shipped in the package.

The files are read once from the package (server/static/, package-data) and served as they are:
no build step, nothing from a CDN, and the Content-Security-Policy keeps the page from loading
anything but its own files and this server's API. The page itself holds no data, so it is served
without the API key; it asks for the key and sends it on every API call (/v1/dashboard/stream too).
It is served while the model still loads too (server/deferred.py), and then shows /health's progress.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

_ASSETS = {"index.html": "text/html; charset=utf-8", "webui.js": "text/javascript; charset=utf-8",
           "webui.css": "text/css; charset=utf-8"}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                       "script-src 'self'; connect-src 'self'; frame-ancestors 'none'"}


def load_assets() -> dict[str, bytes]:
    folder = resources.files("conveyor.server") / "static"
    return {name: (folder / name).read_bytes() for name in _ASSETS}


class PageFiles:
    """The page's files, read once; each answered with its content type and the page's headers."""

    def __init__(self) -> None:
        self.assets = load_assets()

    def response(self, name: str) -> Response:
        if name not in self.assets:
            return Response(status_code=404)
        return Response(self.assets[name], media_type=_ASSETS[name], headers=_HEADERS)

    def for_path(self, path: str) -> Response | None:
        """What `/` and `/webui/{name}` answer; None for any other path (server/deferred.py, before the app)."""
        if path == "/":
            return self.response("index.html")
        if path.startswith("/webui/"):
            return self.response(path.removeprefix("/webui/"))
        return None


def add_webui_routes(app: FastAPI) -> None:
    """`/` (the page) and `/webui/{name}` (its script and style sheet)."""
    files = PageFiles()

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return files.response("index.html")

    @app.get("/webui/{name}", include_in_schema=False)
    async def webui_file(name: str) -> Response:
        return files.response(name)
