"""Connection hygiene under uvicorn: a bound on connections, on the time and bytes a request may take to
arrive, and on how many may be arriving at once (slowloris), below the ASGI app.

uvicorn's own HTTP protocol (httptools or h11) does the HTTP; GuardedProtocol sits between it and the
transport and sees each connection's bytes, while ConnectionGuard.asgi tells it when a request's
headers are complete (the app is called) and when its response is. A connection is "arriving" from
accept, or from the first byte after a response, until its next request reaches the app:

- more than ``max_connections`` open: the new one is answered 503 (OpenAI's error body) and closed;
- arriving for longer than ``read_timeout``, or more than ``max_header_bytes`` before the app is
  called: 408 / 431 and closed;
- more than ``max_incomplete`` arriving at once: the ones arriving for longer than ``grace`` are
  closed, oldest first (a client sending its request at once is never the oldest; a slowloris is).

Every close that may leave unread bytes (a refused body) is a lingering close: the answer is sent,
the write side shut, and what the client still sends is read and dropped for up to ``linger``
seconds, so the client reads the answer instead of a connection reset.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.utils import get_remote_addr

from kiln.errors import require
from kiln.runtime.server.protocol import error_body

Peer = tuple[str, int]


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 512
    read_timeout: float = 10.0  # seconds for a request's headers (and limits.BodyLimit's, for its body)
    max_incomplete: int = 64
    grace: float = 1.0  # while too many arrive, those arriving longer than this are closed
    max_header_bytes: int = 1 << 20  # bytes before the app is called (headers, and the body the parser buffers)
    linger: float = 2.0

    def __post_init__(self) -> None:
        require(self.max_connections >= 1, "max_connections", ">= 1", self.max_connections)
        require(self.read_timeout > 0, "read_timeout", "> 0", self.read_timeout)
        require(1 <= self.max_incomplete <= self.max_connections, "max_incomplete", "in [1, max_connections]",
                self.max_incomplete)
        require(self.grace >= 0 and self.linger >= 0, "grace", ">= 0 (and linger too)", (self.grace, self.linger))


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def raw_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's error shape, for a connection the app never sees."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    if status == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


class ConnectionGuard:
    """The limits' state for one server: open connections, and the ones arriving, oldest first."""

    def __init__(self, limits: ConnectionLimits, on_refuse: Callable[[int], None] = lambda status: None) -> None:
        """on_refuse(status): called for each connection refused here (the app's rejection metric)."""
        self.limits, self.on_refuse = limits, on_refuse
        self.open: dict[Peer, GuardedProtocol] = {}
        self.arriving: dict[GuardedProtocol, float] = {}  # insertion order = arrival order

    def protocol(self, inner: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
        """uvicorn's ``http=``: GuardedProtocol around ``inner``, made with uvicorn's own arguments."""
        guard = self

        class Guarded(GuardedProtocol):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(guard, lambda: inner(**kwargs))

        return Guarded

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """``app`` telling the guard when a request reaches it and when its response is complete."""
        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            client = scope.get("client") if scope["type"] == "http" else None
            conn = self.open.get(tuple(client)) if client is not None else None
            if conn is None:
                return await app(scope, receive, send)
            conn.request_started()

            async def watched_send(message: Message) -> None:
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    conn.response_finished()

            await app(scope, receive, watched_send)

        return guarded

    def start_arriving(self, conn: GuardedProtocol) -> None:
        loop = asyncio.get_running_loop()
        self.arriving[conn] = loop.time()
        if len(self.arriving) > self.limits.max_incomplete:
            self._shed(loop.time())

    def _shed(self, now: float) -> None:
        """Close the longest-arriving connections past ``grace`` until at most max_incomplete arrive."""
        for conn, since in list(self.arriving.items()):
            if len(self.arriving) <= self.limits.max_incomplete or now - since < self.limits.grace:
                break
            conn.refuse(408, f"Too many requests are arriving slowly; this one took more than {self.limits.grace:g} s.",
                        "request_timeout")


class _LingeringTransport:
    """The transport as uvicorn's protocol sees it: its close() is GuardedProtocol's lingering close."""

    def __init__(self, transport: asyncio.Transport, conn: GuardedProtocol) -> None:
        self._transport, self._conn = transport, conn

    def close(self) -> None:
        self._conn.linger()

    def is_closing(self) -> bool:
        return self._conn.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(asyncio.Protocol):
    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self.guard, self._make_inner = guard, make_inner
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None
        self.lingering = self.lost = False
        self._running = False  # from the app being called until its response is complete
        self._arriving_bytes = 0
        self._headers_done = False
        self._header_tail = b""
        self._timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream server's (uvloop's too, unregistered)
        self.peer = get_remote_addr(self.transport)
        limits = self.guard.limits
        if len(self.guard.open) >= limits.max_connections:
            self.guard.on_refuse(503)
            self.lingering = True  # never handed to uvicorn: only the answer, then the close
            self._write_and_linger(raw_response(503, f"The server has its limit of {limits.max_connections} open "
                                                     "connections (kiln serve --max-connections); retry later.",
                                                "too_many_connections"))
            return
        self.guard.open[self._key] = self
        self.inner = self._make_inner()
        self.inner.connection_made(_LingeringTransport(self.transport, self))  # type: ignore[arg-type]
        self._start_arriving()

    def data_received(self, data: bytes) -> None:
        if self.lingering or self.inner is None:
            return  # the rest of a refused request: dropped
        if not self._running and self not in self.guard.arriving:
            self._start_arriving()  # the first byte of the next request on a kept-alive connection
        if self in self.guard.arriving and not self._headers_done:
            # Only the header block counts: a body sent right behind it may arrive before the app is called.
            seen = self._header_tail + data
            end = seen.find(b"\r\n\r\n")
            self._headers_done = end >= 0
            self._arriving_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._header_tail))
            self._header_tail = seen[-3:]
            if self._arriving_bytes > self.guard.limits.max_header_bytes:
                self.refuse(431, f"The request headers are larger than {self.guard.limits.max_header_bytes} bytes.",
                            "headers_too_large")
                return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.lingering:
            self._close_now()
            return None
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._stop_arriving()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self.guard.open.get(self._key) is self:
            del self.guard.open[self._key]
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    @property
    def _key(self) -> Peer:
        return self.peer if self.peer is not None else ("", id(self))  # no peer address: not the app's to find

    # -- the request's arrival -------------------------------------------------------------------

    def _start_arriving(self) -> None:
        self._arriving_bytes = 0
        self._headers_done = False
        self._header_tail = b""
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.guard.limits.read_timeout, self._timed_out)
        self.guard.start_arriving(self)

    def _stop_arriving(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.guard.arriving.pop(self, None)

    def _timed_out(self) -> None:
        self._timer = None
        self.refuse(408, f"The request did not arrive within {self.guard.limits.read_timeout:g} s "
                         "(kiln serve --read-timeout).", "request_timeout")

    def request_started(self) -> None:
        self._running = True
        self._stop_arriving()

    def response_finished(self) -> None:
        self._running = False  # idle: uvicorn's keep-alive timeout closes it, or its next byte starts a request

    # -- closing ---------------------------------------------------------------------------------

    def refuse(self, status: int, message: str, code: str) -> None:
        """Answer a request the app has not seen (never one it is answering) and close the connection."""
        if self.lingering or self.lost or self._running:
            return
        self.guard.on_refuse(status)
        self._stop_arriving()
        self._write_and_linger(raw_response(status, message, code))

    def _write_and_linger(self, answer: bytes) -> None:
        assert self.transport is not None
        self.transport.write(answer)
        self.linger()

    def linger(self) -> None:
        """Shut the write side once what is written has gone, drop what still comes, close at EOF or after
        ``linger`` seconds. Over TLS (no half-close) it closes at once, and aborts after ``linger`` seconds
        a TLS shutdown the client does not answer."""
        if self.lost or self._linger_timer is not None or self.transport is None:
            return
        self.lingering = True
        self._stop_arriving()
        transport = self.transport
        loop = asyncio.get_running_loop()
        if not transport.can_write_eof():  # TLS: close() sends close_notify and waits for the peer's; an idle
            transport.close()  # keep-alive client never answers, so that wait (30 s in asyncio) is cut short
            self._linger_timer = loop.call_later(self.guard.limits.linger, transport.abort)
            return
        if self.guard.limits.linger == 0:
            transport.close()
            return
        transport.write_eof()
        transport.resume_reading()  # uvicorn may have paused reading a body it did not want
        self._linger_timer = loop.call_later(self.guard.limits.linger, self._close_now)

    def _close_now(self) -> None:
        if self.transport is not None:
            self.transport.close()
