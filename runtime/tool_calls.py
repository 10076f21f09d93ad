"""Tool calling without a server: the tools in the prompt, the constraint that forces a call, and the model's calls
parsed out of its text, over plain OpenAI-shaped dicts. The HTTP server's tools (runtime/server/tools.py) validate
the request body and use these; LLM.chat(tools=...) uses them directly.

Tools are OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}; a call is
{"id", "type": "function", "function": {"name", "arguments": JSON text}}.

Prompt: a chat template that takes tools (Hermes/Qwen, Llama 3.1+, Mistral) gets them itself. One that takes none
(SmolLM2's) gets them Hermes-style (NousResearch's function-calling format, which SmolLM2's instruct data follows):
a system message listing the tools' JSON signatures inside <tools></tools> and asking for each call as
<tool_call>{"name": ..., "arguments": {...}}</tool_call>; earlier assistant calls are written back in that form and
tool results as <tool_response> turns (hermes_messages).

Choices: "auto" lets the model answer or call, and parses its text (Hermes <tool_call> blocks; Mistral's
[TOOL_CALLS] [...]; a Llama 3 JSON object {"name", "parameters"}); "required" constrains the output to a JSON array
of calls (one call when parallel is off) whose arguments follow each tool's parameters schema, whatever the
template's own call syntax (the same grammar for every family, so a forced call works on any model); "named"
constrains it to that one function's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from kiln.errors import InvalidParamError
from kiln.runtime.structured import StructuredOutput

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's call opener, when special tokens are kept in the text
MARKERS = (HERMES_OPEN, MISTRAL_MARK, PYTHON_TAG)
CHOICES = ("auto", "required", "named")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

_SYSTEM = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
           "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
           "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
           "For each function call return a json object with function name and arguments within "
           "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
           '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>')


def check_tools(tools: Sequence[dict[str, Any]]) -> None:
    """Each tool a function with a name and a usable parameters schema; names unique. InvalidParamError names
    the tool's field."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidParamError(f"tools.{i} must be {{'type': 'function', 'function': {{...}}}}", f"tools.{i}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidParamError(f"tools.{i}.function.name must be 1-64 letters, digits, '_', '.' or '-', got "
                                    f"{name!r}", f"tools.{i}.function.name")
        if name in seen:
            raise InvalidParamError(f"tools.{i}.function.name {name!r} is given twice", f"tools.{i}.function.name")
        seen.add(name)
        if "parameters" not in function:
            raise InvalidParamError(f"tools.{i}.function.parameters is required (a forced call is constrained to "
                                    "it)", f"tools.{i}.function.parameters")
        StructuredOutput.json_schema(function["parameters"], f"tools.{i}.function.parameters")


def tool_name(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"])


def forced_call(tools: Sequence[dict[str, Any]], choice: str, name: str | None = None,
                parallel: bool = True) -> StructuredOutput | None:
    """The grammar that forces the call(s) for `choice` (one of CHOICES): None for auto."""
    if choice == "auto":
        return None
    if choice == "named":
        tool = next(t for t in tools if tool_name(t) == name)
        return StructuredOutput.json_schema(tool["function"]["parameters"], "tool_choice")
    calls = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
              "properties": {"name": {"const": tool_name(t)}, "arguments": t["function"]["parameters"]}}
             for t in tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutput.json_schema(array, "tool_choice")


def parse_output(text: str, tools: Sequence[dict[str, Any]], choice: str,
                 name: str | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a finished output of `choice`; a forced output cut short (max_tokens, a stop string)
    is all content."""
    if choice == "named":
        assert name is not None
        return None, [make_call(name, text)]
    if choice == "required":
        try:
            return None, [make_call(c["name"], c["arguments"]) for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []
    return parse_calls(text, {tool_name(t) for t in tools})


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def loads_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the calls or None, calls) of a model's own tool-call syntax; text without a parseable call
    for one of `names` is all content."""
    stripped = text.strip()
    candidates: list[Any] = []
    content = text
    if HERMES_OPEN in text:
        content = text[: text.index(HERMES_OPEN)]
        for body in _HERMES.findall(text):  # an object, or a list of them (SmolLM2's function-calling data)
            parsed = loads_arguments(body)
            candidates += parsed if isinstance(parsed, list) else [parsed]
    elif MISTRAL_MARK in text:
        content = text[: text.index(MISTRAL_MARK)]
        parsed = loads_arguments(text[text.index(MISTRAL_MARK) + len(MISTRAL_MARK):].strip())
        candidates = parsed if isinstance(parsed, list) else [parsed]
    elif stripped.removeprefix(PYTHON_TAG).lstrip().startswith("{"):  # Llama 3's JSON call
        content = ""
        candidates = [loads_arguments(stripped.removeprefix(PYTHON_TAG))]
    calls = []
    for c in candidates:
        if not (isinstance(c, dict) and c.get("name") in names):
            return text, []  # not a call of ours: the model was just writing
        calls.append(make_call(c["name"], c.get("arguments", c.get("parameters", {}))))
    return (content.strip() or None) if calls else text, calls


# -- the prompt, for a template without tools ------------------------------------------------------------------

def hermes_call(name: str, arguments: str) -> str:
    return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': loads_arguments(arguments)})}\n{HERMES_CLOSE}"


def hermes_messages(messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The conversation ({"role", "content", "tool_calls"?} dicts) as plain {"role", "content"} turns: the tools'
    system prompt first (merged into the caller's system message), assistant calls as <tool_call> blocks, tool
    results as <tool_response> turns."""
    out: list[dict[str, str]] = []
    for m in messages:
        item = {"role": str(m["role"]), "content": str(m.get("content") or "")}
        if m.get("tool_calls"):
            calls = "\n".join(hermes_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            item["content"] = (item["content"] + "\n" if item["content"] else "") + calls
        if item["role"] == "tool":
            item["content"] = f"<tool_response>\n{item['content']}\n</tool_response>"
        out.append(item)
    if tools:
        system = _SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
