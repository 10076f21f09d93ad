"""`kiln serve`'s ASGI app: an OpenAI-compatible HTTP API (FastAPI) on AsyncLLM.

One HTTP request is one (or, for a batch of prompts, several) engine requests. Its body is read
within limits.py's size and time bounds, then decoded, rendered through the chat template and
tokenized on the worker pool (bodies.py, offload.py), so the event loop only moves bytes (work
smaller than the trip to a worker, a short request's, stays on the loop: offload.run_sized); the
prepared requests are admitted against the queue bound in one step with no await in between
(admission.py), so a burst cannot pass the check together. A request is bound to its connection
(see streams.py): when the client goes away its engine requests are aborted and their KV blocks
freed. Errors use OpenAI's body shape; an engine exception fails only the request that raised it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # the bare runtime install has no HTTP stack
    raise ImportError(f"kiln serve needs the server extras (pip install 'kiln[server]'): {e}") from e

import kiln
from kiln.errors import InvalidParamError, require
from kiln.runtime.outputs import merge_outputs
from kiln.runtime.server.admission import admit, check_length, token_prompts_fit
from kiln.runtime.server.auth import ApiKeyAuth
from kiln.runtime.server.bodies import body_schemas, openapi_body, parse_body
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.formatting import ResponseFormatter
from kiln.runtime.server.images import names_files, take_images
from kiln.runtime.server.limits import BodyLimit, RequestLimits, default_max_request_bytes
from kiln.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from kiln.runtime.server.offload import INLINE_TEMPLATE_BYTES, INLINE_TOKEN_IDS, INLINE_TOKENIZE_CHARS, Offload
from kiln.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
)
from kiln.runtime.server.reasoning import (
    REASONING_PARSERS,
    ReasoningSplitter,
    constrain_after_thinking,
    opens_thinking,
    reasoning_enabled,
    think_tags_are_tokens,
)
from kiln.runtime.server.responses_api import ResponsesRequest, response_body, stream_events
from kiln.runtime.server.streams import (
    ClientDisconnected,
    Drain,
    ServerShuttingDown,
    engine_stream,
    sse_stream,
)
from kiln.runtime.server.tool_templates import native_messages, template_tools
from kiln.runtime.server.tools import ToolMode, ToolResponses, render_messages

log = logging.getLogger("kiln.server")


# ---- handlers --------------------------------------------------------------------------

def _check_model(state: Any, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{state.model_names[0]}'.", "model", "model_not_found")


async def _run(request: Request, body: CompletionRequest | ChatCompletionRequest,
               prompts: list[str | list[int]], chat: bool, images: list[Any] | None = None) -> Response:
    state = request.app.state
    _check_model(state, body.model)
    if state.drain.expired.is_set():
        raise APIError(503, "The server is shutting down.", code="server_shutting_down")
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
    try:
        params = body.sampling_params()
        mode = body.tool_mode() if isinstance(body, ChatCompletionRequest) else None
        if mode is not None and mode.choice == "auto" and state.llm.tool_family == "mistral":
            params = dataclasses.replace(params, skip_special_tokens=False)  # [TOOL_CALLS] is a special token
        thinks = chat and state.reasoning
        if thinks:
            params = constrain_after_thinking(params, opens_thinking(str(prompts[0])), state.think_tags_are_tokens)
        streams = await admit(state, prompts, params, ids, images or [])
    except InvalidParamError as e:
        raise APIError(400, str(e), e.param) from None
    except APIError:
        raise
    except Exception as e:
        log.exception("request %s failed", request_id)
        raise APIError(500, f"Internal error: {type(e).__name__}: {e}") from None
    fmt = ResponseFormatter(chat, request_id, state.model_names[0], params)
    fmt.tools = None if mode is None else ToolResponses(mode)
    if thinks:
        fmt.reasoning = ReasoningSplitter(opens_thinking(str(prompts[0])), state.llm.detokenize)
    stream = engine_stream(request, streams, ids, params, request_id)
    try:
        first = await stream.__anext__()
        if body.stream:
            return StreamingResponse(sse_stream(first, stream, fmt, body.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        deltas = {first[0]: [first[1]]}
        async for i, out in stream:
            deltas.setdefault(i, []).append(out)
        return JSONResponse(fmt.response({i: merge_outputs(d) for i, d in deltas.items()}))
    except ClientDisconnected:
        return Response(status_code=499)
    except ServerShuttingDown as e:
        raise APIError(503, str(e), code="server_shutting_down") from None
    except InvalidParamError as e:
        raise APIError(400, str(e), e.param) from None
    except APIError:
        raise
    except Exception as e:
        log.exception("request %s failed", request_id)
        raise APIError(500, f"Internal error: {type(e).__name__}: {e}") from None
    finally:
        if not body.stream:
            await stream.aclose()


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


def build_app(load_llm: Callable[[], Any], served_model_name: str | None = None, max_queue: int | None = None,
              api_key: str | None = None, limits: RequestLimits | None = None,
              reasoning_parser: str = "auto") -> FastAPI:
    """The ASGI app. ``load_llm`` is called at startup (inside the event loop); the engine
    is shut down when the app's lifespan ends (uvicorn's graceful shutdown, e.g. SIGTERM).
    max_queue: 503 once that many engine requests wait; api_key: Bearer auth on all but /health;
    limits: the request-size and body-time bounds (413 and 408 before anything parses a body);
    reasoning_parser: one of reasoning.REASONING_PARSERS (<think> split into reasoning_content)."""
    require(max_queue is None or max_queue >= 1, "max_queue", ">= 1 (omit it for no bound)", max_queue)
    require(api_key is None or bool(api_key), "api_key", "a non-empty string", api_key)
    require(reasoning_parser in REASONING_PARSERS, "reasoning_parser", f"one of {list(REASONING_PARSERS)}",
            reasoning_parser)
    limits = limits or RequestLimits()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.llm = llm = load_llm()
        app.state.model_names = [served_model_name or llm.model_name, llm.model_name]
        app.state.max_request_bytes = limits.max_request_bytes or default_max_request_bytes(llm.max_seq_len)
        app.state.reasoning = reasoning_enabled(reasoning_parser, llm)
        app.state.think_tags_are_tokens = app.state.reasoning and think_tags_are_tokens(llm)
        if app.state.reasoning:
            log.info("reasoning parser on: <think>...</think> goes to reasoning_content")
        app.state.offload = Offload()
        try:
            yield
        finally:
            app.state.llm = None
            app.state.offload.close()
            await llm.shutdown()

    app = FastAPI(title="kiln", version=kiln.__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions on a kiln engine.")
    app.state.llm = None
    app.state.max_queue = max_queue
    app.state.drain = Drain()
    app.state.metrics = ServerMetrics(lambda: app.state.llm.stats() if app.state.llm is not None else None)
    # the floor until startup, when the engine's context length gives the default
    app.state.max_request_bytes = limits.max_request_bytes or default_max_request_bytes(1)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key,
                           on_reject=lambda: app.state.metrics.rejected.labels(status="401").inc())
    app.add_middleware(BodyLimit, limits=lambda: (app.state.max_request_bytes, limits.read_timeout),
                       on_reject=lambda status: app.state.metrics.rejected.labels(status=str(status)).inc())
    _add_error_handlers(app)
    _add_generation_routes(app)
    _add_responses_route(app)
    _add_info_routes(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented way to replace it
    return app


def _add_error_handlers(app: FastAPI) -> None:
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


_GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion (JSON), or with `stream: true` server-sent events ending in "
                         "`data: [DONE]`", "content": {"text/event-stream": {}}},
    400: {"model": ErrorResponse, "description": "Invalid JSON or parameter; prompt + max_tokens too long"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (when the server has one)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    408: {"model": ErrorResponse, "description": "The body did not arrive within --read-timeout"},
    413: {"model": ErrorResponse, "description": "The body is larger than --max-request-bytes"},
    500: {"model": ErrorResponse, "description": "The engine failed on this request"},
    503: {"model": ErrorResponse, "description": "Queue bound reached (see Retry-After), or shutting down"},
}
_INFO_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: _GENERATION_RESPONSES[code] for code in (400, 401, 404, 408, 413)}


# The routes read their bodies themselves (bodies.parse_body: off the event loop); openapi_extra
# declares each body's model, so /openapi.json still documents it.
_BODY_MODELS: list[type[Any]] = [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
                                 DetokenizeRequest]


def _add_generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", summary="Create a completion", responses=_GENERATION_RESPONSES,
              openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, token_prompts_fit(request.app.state.llm.max_seq_len))
        return await _run(request, body, body.prompts(), chat=False)

    @app.post("/v1/chat/completions", summary="Create a chat completion", responses=_GENERATION_RESPONSES,
              openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        prompt, images = await _render_chat(request, body.messages, tools=_tool_mode(body))
        return await _run(request, body, [prompt], chat=True, images=images)


def _add_responses_route(app: FastAPI) -> None:
    @app.post("/v1/responses", summary="Create a model response (OpenAI's Responses API)",
              responses=_GENERATION_RESPONSES, openapi_extra=openapi_body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        try:
            chat = body.chat_request()
        except InvalidParamError as e:
            raise APIError(400, str(e), e.param) from None
        prompt, images = await _render_chat(request, chat.messages, tools=_tool_mode(chat))
        answer = await _run(request, chat, [prompt], chat=True, images=images)
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(stream_events(answer.body_iterator, body), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not isinstance(answer, JSONResponse):  # the client left
            return answer
        return JSONResponse(response_body(json.loads(bytes(answer.body)), body))


def _tool_mode(chat: ChatCompletionRequest) -> ToolMode | None:
    try:
        return chat.tool_mode()
    except InvalidParamError as e:
        raise APIError(400, str(e), e.param) from None


def _render_with_images(llm: Any, messages: Sequence[Any], add_generation_prompt: bool,
                        tools: ToolMode | None = None) -> tuple[str, list[Any]]:
    """_render, and the conversation's images (decoded; each an image placeholder in the text)."""
    messages, images = take_images(messages, getattr(llm, "image_placeholder", None),
                                   getattr(llm, "allowed_media_dir", None))
    return _render(llm, messages, add_generation_prompt, tools), images


def _render(llm: Any, messages: Sequence[Any], add_generation_prompt: bool, tools: ToolMode | None = None) -> str:
    """The conversation through the chat template (a worker thread): the tools and earlier calls handed to a
    template that takes them, else written in Hermes-style; refused untouched when its messages alone are longer
    than max_model_len tokens can hold."""
    family = llm.tool_family
    native = family is not None
    conversation = native_messages(list(messages), family) if native else render_messages(list(messages), tools)
    check_length(llm, sum(len(m["content"] or "") for m in conversation), "messages")
    try:
        if native and tools is not None:
            return str(llm.apply_chat_template(conversation, add_generation_prompt, tools=template_tools(tools)))
        return str(llm.apply_chat_template(conversation, add_generation_prompt))
    except Exception as e:  # a template may reject a conversation (e.g. role order)
        raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None


async def _render_chat(request: Request, messages: Sequence[Any], add_generation_prompt: bool = True,
                       tools: ToolMode | None = None) -> tuple[str, list[Any]]:
    """The conversation rendered: on the event loop when the request's body (read and kept by then: its size
    bounds the conversation's) is small and names no image file, else on the worker pool."""
    state = request.app.state
    size = len(await request.body()) + (INLINE_TEMPLATE_BYTES if names_files(messages) else 0)
    try:
        text, images = await state.offload.run_sized(size, INLINE_TEMPLATE_BYTES,
                                                     _render_with_images, state.llm, messages,
                                                     add_generation_prompt, tools)
        return str(text), images
    except InvalidParamError as e:
        raise APIError(400, str(e), e.param) from None


def _model_card(state: Any) -> dict[str, Any]:
    # input_modalities: what a request may carry (OpenRouter's name); the chat page shows its image button by it
    images = getattr(state.llm, "image_placeholder", None) is not None
    return {"id": state.model_names[0], "object": "model", "created": 0, "owned_by": "kiln",
            "max_model_len": state.llm.max_seq_len, "input_modalities": ["text", "image"] if images else ["text"]}


def _add_info_routes(app: FastAPI) -> None:
    # response_model=None: the return annotations are for the type checker, not a response schema.
    @app.get("/v1/models", summary="List the served model", response_model=None, responses=_INFO_RESPONSES)
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(request.app.state)]}

    @app.get("/v1/models/{model:path}", summary="Describe a served model", response_model=None,
             responses=_INFO_RESPONSES)
    async def model(model: str, request: Request) -> dict[str, Any]:
        _check_model(request.app.state, model)
        return _model_card(request.app.state)

    @app.post("/tokenize", summary="Tokenize a prompt or chat messages (vLLM's API)", responses=_INFO_RESPONSES,
              openapi_extra=openapi_body(TokenizeRequest), response_model=TokenizeResponse)
    async def tokenize(request: Request) -> TokenizeResponse:
        body = await parse_body(request, TokenizeRequest)
        state = request.app.state
        _check_model(state, body.model)
        if body.messages is not None:
            text, images = await _render_chat(request, body.messages, body.add_generation_prompt)
            if images:
                raise APIError(400, "messages: /tokenize takes no images (an image's token run is the engine's to "
                                    "expand); send the text parts alone", "messages")
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt or "", body.add_special_tokens is not False
        tokens = await state.offload.run_sized(len(text), INLINE_TOKENIZE_CHARS, state.llm.tokenize, text, special)
        strings = (await state.offload.run_sized(len(tokens), INLINE_TOKEN_IDS, state.llm.token_strings, tokens)
                   if body.return_token_strs else None)
        return TokenizeResponse(count=len(tokens), max_model_len=state.llm.max_seq_len, tokens=tokens,
                                token_strs=strings)

    @app.post("/detokenize", summary="Token ids to text (vLLM's API)", responses=_INFO_RESPONSES,
              openapi_extra=openapi_body(DetokenizeRequest), response_model=DetokenizeResponse)
    async def detokenize(request: Request) -> DetokenizeResponse:
        body = await parse_body(request, DetokenizeRequest)
        state = request.app.state
        _check_model(state, body.model)
        try:
            return DetokenizeResponse(prompt=await state.offload.run_sized(len(body.tokens), INLINE_TOKEN_IDS,
                                                                           state.llm.detokenize, body.tokens))
        except InvalidParamError as e:
            raise APIError(400, str(e), e.param) from None

    @app.get("/version", summary="kiln's version", response_model=None)
    async def version() -> dict[str, str]:
        return {"version": kiln.__version__}

    @app.get("/health", summary="Liveness (never needs the API key)", response_model=None)
    async def health(request: Request) -> dict[str, str]:
        if request.app.state.llm is None:
            raise APIError(503, "The engine is not loaded.")
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The schema without FastAPI's 422: validation errors are answered 400 in OpenAI's shape."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas.update(body_schemas(_BODY_MODELS))
        app.openapi_schema = schema
    return app.openapi_schema
