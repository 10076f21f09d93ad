"""`--api-key`: Bearer authentication on every route but /health and the chat page's static files.

A plain ASGI middleware, not Starlette's BaseHTTPMiddleware: that one wraps the receive
channel, which the handlers watch to notice a client leaving.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.runtime.server.protocol import error_body
from kiln.runtime.server.web import ASSETS

# Liveness probes carry no key, and a browser opening the chat page cannot send one: the page
# asks for the key and sends it with its own API calls.
OPEN_PATHS = frozenset({"/health", *ASSETS})


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None and hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        self._on_reject()
        message = ("Incorrect API key provided." if given is not None else
                   "Missing API key: send it as the header 'Authorization: Bearer <key>'.")
        response = JSONResponse(error_body(401, message, code="invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
