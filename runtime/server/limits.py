"""Request-size and body-time limits, enforced before anything parses a body.

A body larger than ``max_request_bytes`` is refused with 413: at once when its Content-Length says
so, else as soon as the bytes read pass the limit (chunked bodies). A body still incomplete
``read_timeout`` seconds after its headers is refused with 408. Both answers close the connection
(the rest of a refused body is discarded, see connections.py), so a hostile client costs at most
the limit in memory and never a parse.

The default size follows the context length: 1 KiB per token of max_model_len, at least 1 MiB.
A full context of text, even as a batch of prompts with a long stop list, fits well within that;
a body many times larger cannot be a request the engine could take.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.errors import require
from kiln.runtime.server.errors import APIError

BYTES_PER_CONTEXT_TOKEN = 1024
MIN_REQUEST_BYTES = 1 << 20
CLOSE = {"Connection": "close"}  # a refused body is not read on: this connection ends after the answer


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int | None = None  # None: default_max_request_bytes(the engine's max_model_len)
    read_timeout: float = 10.0  # seconds a request's body may take after its headers (and its headers, too)

    def __post_init__(self) -> None:
        require(self.max_request_bytes is None or self.max_request_bytes >= 1, "max_request_bytes",
                ">= 1 (omit it for the default)", self.max_request_bytes)
        require(self.read_timeout > 0, "read_timeout", "> 0", self.read_timeout)


def default_max_request_bytes(max_model_len: int) -> int:
    return max(MIN_REQUEST_BYTES, BYTES_PER_CONTEXT_TOKEN * max_model_len)


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                         "(kiln serve --max-request-bytes).", code="request_too_large", headers=CLOSE)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses a malformed one before the app sees it
                return None
    return None


class BodyLimit:
    """ASGI middleware; ``limits()`` gives (max_request_bytes, read_timeout) when a request comes (the
    size follows the engine's context length, known once the app has started)."""

    def __init__(self, app: ASGIApp, limits: Callable[[], tuple[int, float]],
                 on_reject: Callable[[int], None] = lambda status: None) -> None:
        self.app, self._limits, self._on_reject = app, limits, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, timeout = self._limits()
        length = _content_length(scope)
        if length is not None and length > limit:
            self._on_reject(413)
            return await too_large(limit).response()(scope, receive, send)
        await self.app(scope, _BoundedBody(receive, limit, timeout), send)


class _BoundedBody:
    """The receive channel, counting body bytes against the limit and timing the body; once the body is
    complete it passes messages through (the handlers then watch it for the client leaving)."""

    def __init__(self, receive: Receive, limit: int, timeout: float) -> None:
        self._receive, self._limit, self._timeout = receive, limit, timeout
        self._deadline = asyncio.get_running_loop().time() + timeout
        self._received = 0
        self._complete = False

    async def __call__(self) -> Message:
        if self._complete:
            return await self._receive()
        remaining = self._deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.0))
        except TimeoutError:
            raise APIError(408, f"The request body did not arrive within {self._timeout:g} s "
                                "(kiln serve --read-timeout).", code="request_timeout", headers=CLOSE) from None
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit:
                raise too_large(self._limit)
            self._complete = not message.get("more_body", False)
        else:
            self._complete = True  # http.disconnect: nothing more will come
        return message
