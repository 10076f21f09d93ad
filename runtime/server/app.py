"""`kiln serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on AsyncLLM.

One HTTP request is one (or, for a batch of prompts, several) engine requests. A request
is bound to its connection: when the client goes away (noticed at once by a watcher on
the ASGI receive channel, or by Starlette cancelling the response stream) its engine
requests are aborted and their KV blocks freed. Errors use OpenAI's body shape; an engine
exception fails only the request that raised it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # the bare runtime install has no HTTP stack
    raise ImportError(f"kiln serve needs the server extras (pip install 'kiln[server]'): {e}") from e

from kiln.errors import InvalidParamError
from kiln.runtime.outputs import RequestOutput, merge_outputs
from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.runtime.server.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from kiln.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ResponseFormatter,
    error_body,
)
from kiln.runtime.server.web import add_web_ui

log = logging.getLogger("kiln.server")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the engine's model name
    max_queue: int | None = None  # 503 + Retry-After once this many requests wait
    graceful_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    log_level: str = "info"
    web_ui: bool = True  # the chat page at / (kiln.runtime.server.web)


class ClientDisconnected(Exception):
    pass


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code),
                            status_code=self.status, headers=self.headers)


# ---- one HTTP request's engine requests ----------------------------------------------

async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _abort(llm: Any, request_id: str) -> None:
    try:
        with anyio.move_on_after(5.0):  # never hang a handler on an engine that is going away
            await llm.abort(request_id)
    except Exception:  # already finished or unknown: nothing to free
        log.debug("abort(%s) failed", request_id, exc_info=True)


_EngineStream = AsyncGenerator[tuple[int, RequestOutput], None]  # (prompt index, output delta)


async def _engine_stream(request: Request, prompts: list[str | list[int]], params: SamplingParams,
                         base_id: str) -> _EngineStream:
    """Merged (prompt index, output delta) stream of one engine request per prompt.

    Raises ClientDisconnected when the client leaves; on any exit, aborts what is unfinished.
    """
    llm, metrics = request.app.state.llm, request.app.state.metrics
    ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
    timers = [RequestTimer(metrics) for _ in prompts]
    # (prompt index, output delta or None once its stream ends, the exception that ended it)
    queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in llm.generate(prompts[i], params, ids[i]):
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))  # ended (normally after a finished output)
        except Exception as e:  # handed to the consumer, which raises it in the handler
            queue.put_nowait((i, None, e))

    live = set(range(len(prompts)))
    started: set[int] = set()
    num_tokens = [0] * len(prompts)
    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        while live:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait((get, watcher), return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                raise ClientDisconnected()
            i, out, err = get.result()
            if err is not None:
                live.discard(i)  # the engine rejected or failed it: nothing left to abort there
                raise err
            if out is None:
                live.discard(i)
                continue
            if i not in started:
                started.add(i)
                metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            num_tokens[i] += sum(len(o.token_ids) for o in out.outputs)
            timers[i].on_tokens(num_tokens[i])
            if out.finished:
                live.discard(i)
                timers[i].on_finish([o.finish_reason for o in out.outputs])
            yield i, out
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            for i in live:
                metrics.finished.labels(finish_reason="abort").inc(params.n)
                await _abort(llm, ids[i])
            await asyncio.gather(*tasks, watcher, return_exceptions=True)


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _sse_stream(first: tuple[int, RequestOutput], stream: _EngineStream, fmt: ResponseFormatter,
                      include_usage: bool) -> AsyncIterator[str]:
    deltas: dict[int, list[RequestOutput]] = {}
    try:
        item = first
        while True:
            deltas.setdefault(item[0], []).append(item[1])
            for chunk in fmt.chunks(item[0], item[1], include_usage):
                yield _sse(chunk)
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                break
        if include_usage:
            yield _sse(fmt.usage_chunk({i: merge_outputs(d) for i, d in deltas.items()}))
    except ClientDisconnected:
        return
    except InvalidParamError as e:  # headers are sent: report in-band, then end the stream
        yield _sse(error_body(400, str(e), e.param))
    except Exception as e:
        log.exception("request %s failed mid-stream", fmt.id)
        yield _sse(error_body(500, str(e) or type(e).__name__))
    finally:
        await stream.aclose()
    yield _sse("[DONE]")


# ---- handlers --------------------------------------------------------------------------

async def _run(request: Request, body: CompletionRequest | ChatCompletionRequest,
               prompts: list[str | list[int]], chat: bool) -> Response:
    state = request.app.state
    if body.model is not None and body.model not in state.model_names:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                            f"'{state.model_names[0]}'.", "model", "model_not_found")
    try:
        params = body.sampling_params()
    except InvalidParamError as e:
        raise APIError(400, str(e), e.param) from None
    if state.max_queue is not None and state.llm.num_waiting >= state.max_queue:
        raise APIError(503, f"The server is at its queue bound ({state.max_queue} waiting requests); "
                            "retry later.", code="queue_full", headers={"Retry-After": "1"})
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    fmt = ResponseFormatter(chat, request_id, state.model_names[0], params)
    stream = _engine_stream(request, prompts, params, request_id)
    try:
        first = await stream.__anext__()
        if body.stream:
            return StreamingResponse(_sse_stream(first, stream, fmt, body.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        deltas = {first[0]: [first[1]]}
        async for i, out in stream:
            deltas.setdefault(i, []).append(out)
        return JSONResponse(fmt.response({i: merge_outputs(d) for i, d in deltas.items()}))
    except ClientDisconnected:
        return Response(status_code=499)
    except InvalidParamError as e:
        raise APIError(400, str(e), e.param) from None
    except APIError:
        raise
    except Exception as e:
        log.exception("request %s failed", request_id)
        raise APIError(500, f"Internal error: {type(e).__name__}: {e}") from None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc(error: dict[str, Any]) -> str:
    """A field path ("messages.0.role") without "body" and pydantic's union-member tags."""
    parts = [str(p) for p in error.get("loc", ()) if p != "body"]
    return ".".join(p for p in parts if p not in _UNION_TAGS and (p.isidentifier() or p.isdigit()))


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}").response()
    param = _loc(first) or None
    message = "; ".join(f"{_loc(e) or 'body'}: {e.get('msg')}" for e in errors[:5])
    request.app.state.metrics.rejected.labels(status="400").inc()
    return APIError(400, message, param).response()


def build_app(load_llm: Callable[[], Any], served_model_name: str | None = None,
              max_queue: int | None = None) -> FastAPI:
    """The ASGI app. ``load_llm`` is called at startup (inside the event loop); the engine
    is shut down when the app's lifespan ends (uvicorn's graceful shutdown, e.g. SIGTERM)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.llm = llm = load_llm()
        app.state.model_names = [served_model_name or llm.model_name, llm.model_name]
        try:
            yield
        finally:
            app.state.llm = None
            await llm.shutdown()

    app = FastAPI(title="kiln", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions on a kiln engine.")
    app.state.llm = None
    app.state.max_queue = max_queue
    app.state.metrics = ServerMetrics(lambda: app.state.llm.stats() if app.state.llm is not None else None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        request.app.state.metrics.rejected.labels(status=str(exc.status)).inc()
        return exc.response()

    app.exception_handler(RequestValidationError)(_validation_error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"Internal error: {type(exc).__name__}"), status_code=500)

    generation_responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "A completion (JSON), or with `stream: true` server-sent events ending in "
                             "`data: [DONE]`", "content": {"text/event-stream": {}}},
        400: {"model": ErrorResponse, "description": "Invalid JSON or parameter; prompt + max_tokens too long"},
        404: {"model": ErrorResponse, "description": "Unknown model"},
        500: {"model": ErrorResponse, "description": "The engine failed on this request"},
        503: {"model": ErrorResponse, "description": "Queue bound reached (see Retry-After)"},
    }

    @app.post("/v1/completions", summary="Create a completion", responses=generation_responses)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _run(request, body, body.prompts(), chat=False)

    @app.post("/v1/chat/completions", summary="Create a chat completion", responses=generation_responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        llm = request.app.state.llm
        try:
            prompt = llm.apply_chat_template([m.as_dict() for m in body.messages])
        except Exception as e:  # a template may reject a conversation (e.g. role order)
            raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None
        return await _run(request, body, [prompt], chat=True)

    # response_model=None: the return annotations are for the type checker, not a response schema.
    @app.get("/v1/models", summary="List the served model", response_model=None)
    async def models(request: Request) -> dict[str, Any]:
        llm = request.app.state.llm
        card = {"id": request.app.state.model_names[0], "object": "model", "created": 0,
                "owned_by": "kiln", "max_model_len": llm.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.get("/health", summary="Liveness", response_model=None)
    async def health(request: Request) -> dict[str, str]:
        if request.app.state.llm is None:
            raise APIError(503, "The engine is not loaded.")
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:  # validation errors are answered 400 in OpenAI's shape, not FastAPI's 422
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the schema
    return app


def serving_app(load_llm: Callable[[], Any], options: ServeOptions) -> FastAPI:
    """The app `serve` runs: the API, and the chat page unless ``options.web_ui`` is off."""
    app = build_app(load_llm, options.served_model_name, options.max_queue)
    if options.web_ui:
        add_web_ui(app)
    return app


def serve(engine_dir: str | Path, config: RuntimeConfig | None = None, options: ServeOptions = ServeOptions()) -> None:
    """Load ``engine_dir`` and serve it until SIGTERM/SIGINT; returns normally (exit 0).

    The engine loads before the server binds its port, so a bad engine dir fails with the
    loader's one-sentence error and nothing listens half-ready.
    """
    import uvicorn

    from kiln.runtime import AsyncLLM

    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal under the handler
    # it found installed: make that one exit 0 (also when the signal comes before uvicorn is up).
    signal.signal(signal.SIGTERM, _exit_zero)
    signal.signal(signal.SIGINT, _exit_zero)
    llm = AsyncLLM(engine_dir, config)
    uvicorn.run(serving_app(lambda: llm, options), host=options.host, port=options.port, log_level=options.log_level,
                # uvicorn annotates int but hands it to asyncio.wait_for, which takes any seconds
                timeout_graceful_shutdown=options.graceful_timeout)  # type: ignore[arg-type]


def _exit_zero(signum: int, frame: Any) -> None:
    raise SystemExit(0)
