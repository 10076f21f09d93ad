"""A request's output constraint from its OpenAI fields: `response_format` (json_object, json_schema with or
without strict: kiln always enforces the schema) or one of vLLM's extras (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, Lark or GBNF). At most one may be given; each error names the field it came
from, down to the member (`response_format.json_schema.schema`)."""

from __future__ import annotations

from typing import Any

from kiln.errors import InvalidParamError
from kiln.runtime.structured import StructuredOutput

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def response_format_output(value: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's response_format: {"type": "text"} (no constraint), {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object("response_format")
    if kind != "json_schema":
        raise InvalidParamError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                                "response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidParamError("response_format.json_schema must be an object with a 'schema'",
                                "response_format.json_schema")
    if not isinstance(spec.get("strict", False), bool | None):
        raise InvalidParamError("response_format.json_schema.strict must be a boolean",
                                "response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: omitted means any JSON object
    return StructuredOutput.json_schema(schema, "response_format.json_schema.schema")


def structured_output(body: Any) -> StructuredOutput | None:
    """The one constraint a completions or chat request sets (its response_format or a guided_* field)."""
    given = [name for name in ("response_format", *GUIDED_FIELDS) if getattr(body, name, None) is not None]
    if getattr(body, "response_format", None) == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise InvalidParamError(f"give at most one output constraint, got {', '.join(given)}", given[1])
    if not given:
        return None
    name = given[0]
    value = getattr(body, name)
    if name == "response_format":
        return response_format_output(value)
    if name == "guided_json":
        return StructuredOutput.json_schema(value, name)
    if name == "guided_regex":
        return StructuredOutput.regex(value, name)
    if name == "guided_choice":
        return StructuredOutput.choice(value, name)
    return StructuredOutput.grammar(value, name)
