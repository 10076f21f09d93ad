"""`kiln serve`: load an engine, then run the app under uvicorn until SIGTERM/SIGINT.

Shutdown: uvicorn stops accepting connections and waits for running requests; ours end
themselves at ``shutdown_timeout`` (streams with an error event and ``[DONE]``, see
streams.Drain), so uvicorn's own cancellation, a few seconds later, is only a backstop
for a client that stopped reading. Then the lifespan shuts the engine down; exit 0.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import uvicorn
except ImportError as e:  # the bare runtime install has no HTTP stack
    raise ImportError(f"kiln serve needs the server extras (pip install 'kiln[server]'): {e}") from e

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kiln.errors import require
from kiln.runtime.long_lived import freeze_start_up_objects
from kiln.runtime.params import RuntimeConfig
from kiln.runtime.server.app import build_app
from kiln.runtime.server.connections import ConnectionGuard, ConnectionLimits
from kiln.runtime.server.limits import RequestLimits
from kiln.runtime.server.reasoning import REASONING_PARSERS
from kiln.runtime.server.web import add_web_ui

log = logging.getLogger("kiln.server")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_BACKSTOP_S = 5.0  # after the deadline, how long uvicorn waits before cancelling what still runs


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the engine's model name
    max_queue: int | None = None  # 503 + Retry-After once this many engine requests wait
    shutdown_timeout: float = 30.0  # seconds running requests get after SIGTERM before they are ended
    log_level: str = "info"
    access_log: bool = True  # uvicorn's line per request (client, method, path, status) at info
    api_key: str | None = None  # Bearer auth on every route but /health and the chat page's files
    web_ui: bool = True  # the chat page at / (kiln.runtime.server.web)
    max_request_bytes: int | None = None  # 413 above it; None: limits.default_max_request_bytes(max_model_len)
    read_timeout: float = 10.0  # seconds for a request's headers, and again for its body (408 after)
    max_connections: int = 512  # open connections; one more is answered 503 and closed
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None  # given: HTTPS (the key may be in this file, or in ssl_keyfile)
    allowed_origins: tuple[str, ...] = ()  # CORS: other origins whose pages may call the API ("*": any)
    reasoning_parser: str = "auto"  # <think> split into reasoning_content: auto (the tags are tokens), qwen3, none

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", "in [0, 65535]", self.port)
        require(self.max_queue is None or self.max_queue >= 1, "max_queue", ">= 1 (omit it for no bound)",
                self.max_queue)
        require(self.shutdown_timeout >= 0, "shutdown_timeout", ">= 0", self.shutdown_timeout)
        require(self.reasoning_parser in REASONING_PARSERS, "reasoning_parser", f"one of {list(REASONING_PARSERS)}",
                self.reasoning_parser)
        require(self.log_level in LOG_LEVELS, "log_level", f"one of {list(LOG_LEVELS)}", self.log_level)
        require(self.api_key is None or bool(self.api_key), "api_key", "a non-empty string", self.api_key)
        require(self.max_connections >= 1, "max_connections", ">= 1", self.max_connections)
        require(self.ssl_keyfile is None or self.ssl_certfile is not None, "ssl_keyfile",
                "given with ssl_certfile (the certificate it is the key of)", self.ssl_keyfile)
        self.request_limits()  # checks max_request_bytes and read_timeout

    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.max_request_bytes, self.read_timeout)

    def connection_limits(self) -> ConnectionLimits:
        # slowloris bound: a quarter of the connections may be arriving slowly at once (at most 64)
        return ConnectionLimits(max_connections=self.max_connections, read_timeout=self.read_timeout,
                                max_incomplete=max(1, min(64, self.max_connections // 4)))


def configure_logging(level: str) -> None:
    """kiln's loggers (the start-up summary, one line per request) at ``level``, on stderr."""
    logger = logging.getLogger("kiln")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def serving_app(load_llm: Callable[[], Any], options: ServeOptions) -> FastAPI:
    """The app `serve` runs: the API, and the chat page unless ``options.web_ui`` is off."""
    app = build_app(load_llm, options.served_model_name, options.max_queue, options.api_key, options.request_limits(),
                    options.reasoning_parser)
    if options.web_ui:
        add_web_ui(app)
    if options.allowed_origins:  # outside the API key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    return app


def serve(engine_dir: str | Path, config: RuntimeConfig | None = None, options: ServeOptions = ServeOptions()) -> None:
    """Load ``engine_dir`` and serve it until SIGTERM/SIGINT; returns normally (exit 0).

    The engine loads before the server binds its port, so a bad engine dir fails with the
    loader's one-sentence error and nothing listens half-ready.
    """
    from kiln.runtime import AsyncLLM

    configure_logging(options.log_level)
    install_exit_handlers()
    llm = AsyncLLM(engine_dir, config)
    install_exit_handlers()  # again: ray.init (--pipeline-parallel) installed its own, which exits 15
    serve_llm(llm, f"{engine_dir} (max_num_seqs {llm.engine.config.max_num_seqs})", options)


def serve_llm(llm: Any, what: str, options: ServeOptions) -> None:
    """Serve an AsyncLLM-shaped object (AsyncLLM, or the cluster's ClusterLLM) under uvicorn until
    SIGTERM/SIGINT; ``what`` names it in the start-up line."""
    app = serving_app(lambda: llm, options)
    scheme = "https" if options.ssl_certfile else "http"
    log.info("serving %s as %r on %s://%s:%d (queue bound %s, shutdown deadline %g s, API key %s, at most %d "
             "connections, request read timeout %g s)", what, options.served_model_name or llm.model_name, scheme,
             options.host, options.port, options.max_queue or "none", options.shutdown_timeout,
             "required" if options.api_key else "off", options.max_connections, options.read_timeout)
    guard = ConnectionGuard(options.connection_limits(),
                            on_refuse=lambda status: app.state.metrics.rejected.labels(status=str(status)).inc())
    uvicorn_config = guarded_config(app, options, guard)
    freeze_start_up_objects()
    _DrainingServer(uvicorn_config, lambda: app.state.drain.start(options.shutdown_timeout)).run()


def guarded_config(app: FastAPI, options: ServeOptions, guard: ConnectionGuard) -> uvicorn.Config:
    """uvicorn's settings for ``app``: its HTTP protocol under ``guard`` (connections.py), TLS when asked."""
    return uvicorn.Config(
        guard.asgi(app), http=guard.protocol(AutoHTTPProtocol), host=options.host, port=options.port,
        log_level=options.log_level, access_log=options.access_log, ssl_keyfile=options.ssl_keyfile,
        ssl_certfile=options.ssl_certfile,
        # uvicorn annotates int but hands it to asyncio.wait_for, which takes any seconds
        timeout_graceful_shutdown=options.shutdown_timeout + _BACKSTOP_S)  # type: ignore[arg-type]


def install_exit_handlers() -> None:
    """uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal under the handler it
    found installed: make that one exit 0 (also when the signal comes before uvicorn is up)."""
    signal.signal(signal.SIGTERM, _exit_zero)
    signal.signal(signal.SIGINT, _exit_zero)


def _exit_zero(signum: int, frame: Any) -> None:
    raise SystemExit(0)


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server, telling the app when shutdown begins so it can start its deadline."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)
