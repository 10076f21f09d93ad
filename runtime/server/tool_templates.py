"""Chat templates that take tools themselves (Hermes and Qwen, Llama 3.1+, Mistral): the conversation handed to
them the way Hugging Face's templates read it, so each model sees its tools and its earlier calls in the syntax it
was trained on. The tools go in as `tools` (OpenAI's {"type": "function", "function": {...}} list); an assistant's
calls as `tool_calls` [{"id", "type", "function": {"name", "arguments"}}] with the arguments as an object (the
templates write them with `tojson`); a tool result as a "tool" message with its `tool_call_id`.

Mistral's templates accept only 9-character alphanumeric call ids (they raise otherwise), so for that family
each id is mapped to one, the same way in the assistant's call and in the tool's answer.

A template without tools (SmolLM2's) gets them from tools.render_messages instead: the Hermes system prompt.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from kiln.runtime.server.tools import ToolMode
from kiln.runtime.tool_calls import loads_arguments

FAMILIES = ("hermes", "llama3", "mistral")
_MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")


def native_messages(messages: list[Any], family: str) -> list[dict[str, Any]]:
    """The conversation as a tool-taking template of `family` (one of FAMILIES) reads it."""
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = m.as_dict()
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            item["tool_calls"] = [{"id": _call_id(c.id, family), "type": "function", "function": {
                "name": c.function.name, "arguments": loads_arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.role == "tool" and m.tool_call_id is not None:
            item["tool_call_id"] = _call_id(m.tool_call_id, family)
        out.append(item)
    return out


def template_tools(mode: ToolMode) -> list[dict[str, Any]]:
    """The request's tools as a template's `tools` variable."""
    return [t.model_dump(exclude_none=True) for t in mode.tools]


def _call_id(call_id: str | None, family: str) -> str | None:
    if family != "mistral" or call_id is None or _MISTRAL_ID.match(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]
