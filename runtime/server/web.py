"""The chat page at `/`: three static files from the package, answered from memory.

The page talks to this server's own /v1/models and /v1/chat/completions (streaming), so its
Content-Security-Policy allows nothing from any other origin: scripts, styles, the icon and
fetches are 'self' only; no inline script or style, no frames, no forms posting elsewhere.
`kiln serve --no-web-ui` leaves these routes out (`/` is then a 404 like any unknown path).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' blob:",  # blob: the thumbnails of images the user attaches, made by the page from their files
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
))

# URL path -> (file under static/, media type). A fixed table: no path from the request reaches the filesystem.
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
}

HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",  # a browser never runs a file as another type than the one sent
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a kiln upgrade serves its own page at once
}


def read_asset(name: str) -> bytes:
    return resources.files("kiln.runtime.server").joinpath("static", name).read_bytes()


def _answer(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)
    return asset


def add_web_ui(app: FastAPI) -> None:
    """Serve the chat page and its assets on ``app`` (read here, so a missing file fails at startup)."""
    for path, (name, media_type) in ASSETS.items():
        app.add_api_route(path, _answer(read_asset(name), media_type), methods=["GET", "HEAD"],
                          include_in_schema=False)
