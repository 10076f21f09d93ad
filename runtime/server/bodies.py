"""Request bodies: read (within limits.BodyLimit's size and time bounds), then decoded and validated
on the worker pool (a small body, on the event loop: offload.run_sized). Errors keep FastAPI's shape
(RequestValidationError), so the app's one handler answers them all with a 400 naming the field.

The routes take the raw Request and declare their body model for /openapi.json (openapi_body), so
the schema stays the contract the server enforces.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from kiln.errors import InvalidParamError
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.offload import INLINE_BODY_BYTES

M = TypeVar("M", bound=BaseModel)


def _json_error(message: str, position: int = 0) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error",
                                    "input": {}, "ctx": {"error": message}}])


Precheck = Callable[[Any], None]  # a look at the decoded JSON before validation; InvalidParamError to refuse


def _no_precheck(data: Any) -> None:
    pass


def decode(raw: bytes, model: type[M], precheck: Precheck = _no_precheck) -> M:
    """JSON bytes -> a validated ``model`` (worker thread); RequestValidationError for bad input.
    ``precheck`` sees the decoded JSON first: a cheap refusal (a size) spares validating every element."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _json_error(e.msg, e.pos) from None
    except UnicodeDecodeError as e:  # json.loads reads UTF-8/16/32 bytes; anything else fails here
        raise _json_error(f"the body is not UTF-8 text ({e.reason} at byte {e.start})", e.start) from None
    except RecursionError:
        raise _json_error("nested too deeply") from None
    precheck(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None
    except RecursionError:
        raise RequestValidationError([{"type": "value_error", "loc": (), "msg": "nested too deeply"}]) from None


async def parse_body(request: Request, model: type[M], precheck: Precheck = _no_precheck) -> M:
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise APIError(400, "The client closed the connection before sending the whole body.") from None
    try:
        parsed: M = await request.app.state.offload.run_sized(len(raw), INLINE_BODY_BYTES, decode, raw, model, precheck)
    except InvalidParamError as e:
        raise APIError(400, str(e), e.param) from None
    return parsed


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's openapi_extra declaring ``model`` as its JSON body (_openapi adds the schema)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def body_schemas(models: list[type[BaseModel]]) -> dict[str, Any]:
    """The component schemas of ``models`` and of the models they nest."""
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas
