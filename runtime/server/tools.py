"""Tool calling for /v1/chat/completions: the tools in the prompt, the constraint that forces a call, and the
model's calls parsed out of its text into OpenAI's `tool_calls` (whole, or as stream deltas).

Prompt: a chat template that takes tools (Hermes/Qwen, Llama 3.1+, Mistral) gets them itself, with the history's
calls and results in its own form (tool_templates.py). One that takes none (SmolLM2's) gets them Hermes-style
(NousResearch's function-calling format, which SmolLM2's instruct data follows): a system message listing the
tools' JSON signatures inside <tools></tools> and asking for each call as
<tool_call>{"name": ..., "arguments": {...}}</tool_call>; earlier assistant calls are written back in that form
and tool results as <tool_response> turns (render_messages).

tool_choice: "none" sends no tools and parses nothing; "auto" lets the model answer or call, and parses its
text (Hermes <tool_call> blocks; Mistral's [TOOL_CALLS] [...]; a Llama 3 JSON object {"name", "parameters"});
"required" constrains the output to a JSON array of calls (one call when parallel_tool_calls is false) whose
arguments follow each tool's parameters schema; a named function constrains it to that function's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.errors import InvalidParamError
from kiln.runtime.structured import StructuredOutput

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's call opener, when special tokens are kept in the text
_MARKERS = (HERMES_OPEN, MISTRAL_MARK, PYTHON_TAG)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(description="The arguments' JSON schema (required by kiln: it is what a "
                                                   "forced call is constrained to).")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(tools: list[Tool]) -> None:
    """Each tool's parameters must be a usable JSON schema; names unique. InvalidParamError names the tool."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise InvalidParamError(f"tools.{i}.function.name {tool.function.name!r} is given twice",
                                    f"tools.{i}.function.name")
        seen.add(tool.function.name)
        StructuredOutput.json_schema(tool.function.parameters, f"tools.{i}.function.parameters")


@dataclass(frozen=True)
class ToolMode:
    """How one request's output relates to its tools (made by tool_mode)."""

    tools: tuple[Tool, ...]
    choice: Literal["auto", "required", "named"]
    name: str | None = None  # the named function
    parallel: bool = True

    def constraint(self) -> StructuredOutput | None:
        """The grammar that forces the call(s): None for auto."""
        if self.choice == "auto":
            return None
        if self.choice == "named":
            tool = next(t for t in self.tools if t.function.name == self.name)
            return StructuredOutput.json_schema(tool.function.parameters, "tool_choice")
        calls = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                  "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters}}
                 for t in self.tools]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutput.json_schema(array, "tool_choice")

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls as OpenAI tool_calls) of a finished output."""
        if self.choice == "named":
            assert self.name is not None
            return None, [_call(self.name, text)]
        if self.choice == "required":
            try:
                return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)]
            except (json.JSONDecodeError, TypeError, KeyError):  # cut short by max_tokens or a stop string
                return text, []
        return parse_calls(text, {t.function.name for t in self.tools})


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolMode | None:
    """The request's tool mode; None when it sends no tools or tool_choice is "none"."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidParamError("tool_choice needs tools", "tool_choice")
        return None
    check_tools(tools)
    if choice == "none":
        return None
    parallel = parallel is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise InvalidParamError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                    "tool_choice")
        return ToolMode(tuple(tools), "named", choice.function.name, parallel)
    return ToolMode(tuple(tools), choice or "auto", None, parallel)


# -- the prompt ------------------------------------------------------------------------------------------------

_SYSTEM = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
           "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
           "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
           "For each function call return a json object with function name and arguments within "
           "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
           '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>')


def render_messages(messages: list[Any], mode: ToolMode | None) -> list[dict[str, str]]:
    """The conversation as the template's {"role", "content"} dicts: the tools' system prompt first (merged into
    the caller's system message), assistant calls as <tool_call> blocks, tool results as <tool_response> turns."""
    out: list[dict[str, str]] = []
    for m in messages:
        item = m.as_dict()
        if getattr(m, "tool_calls", None):
            calls = "\n".join(_hermes_call(c.function.name, c.function.arguments) for c in m.tool_calls)
            item["content"] = (item["content"] + "\n" if item["content"] else "") + calls
        if item["role"] == "tool":
            item["content"] = f"<tool_response>\n{item['content']}\n</tool_response>"
        out.append(item)
    if mode is not None:
        tools = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in mode.tools)
        system = _SYSTEM.format(tools=tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _hermes_call(name: str, arguments: str) -> str:
    return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': loads_arguments(arguments)})}\n{HERMES_CLOSE}"


def loads_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


# -- parsing ----------------------------------------------------------------------------------------------------

def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


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
        calls.append(_call(c["name"], c.get("arguments", c.get("parameters", {}))))
    return (content.strip() or None) if calls else text, calls


# -- responses --------------------------------------------------------------------------------------------------

@dataclass
class _ChoiceStream:
    held: str = ""  # text not yet sent: a possible call marker's start, or everything from a call on
    in_calls: bool = False
    arguments_started: bool = False
    sent_any: bool = False  # content went out: a JSON object from here on is text, not a Llama 3 call


@dataclass
class ToolResponses:
    """Rewrites a request's chat choices: tool calls out of the text, finish_reason "tool_calls"."""

    mode: ToolMode
    streams: dict[int, _ChoiceStream] = field(default_factory=dict)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        content, calls = self.mode.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            return message, "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A stream chunk's delta for this much new text of choice `index` (role added by the caller)."""
        state = self.streams.setdefault(index, _ChoiceStream())
        if self.mode.choice == "named":  # the text is the arguments: stream them as they come
            first = not state.arguments_started
            state.arguments_started = True
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if first:
                call = {**_call(self.mode.name or "", text), "index": 0}
            return {"tool_calls": [call]}, "tool_calls" if finish_reason == "stop" else finish_reason
        state.held += text
        if finish_reason is None:
            if self.mode.choice == "required" or state.in_calls:
                return {}, None
            cut = _safe_prefix(state.held, not state.sent_any)
            if cut < len(state.held) and _starts_call(state.held[cut:], not state.sent_any and cut == 0):
                state.in_calls = True
            sent, state.held = state.held[:cut], state.held[cut:]
            state.sent_any = state.sent_any or bool(sent)
            return ({"content": sent} if sent else {}), None
        message, reason = self.message(state.held, finish_reason)
        state.held = ""
        delta: dict[str, Any] = {}
        if message.get("content"):
            delta["content"] = message["content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(message["tool_calls"])]
        return delta, reason


def _starts_call(text: str, at_start: bool) -> bool:
    return any(text.startswith(m) for m in _MARKERS) or (at_start and text.lstrip().startswith("{"))


def _safe_prefix(text: str, at_start: bool) -> int:
    """How much of text may be sent as content now: up to a call marker, or up to a suffix that could still
    become one; nothing while the output so far is blank or a JSON object's start (a Llama 3 call)."""
    if at_start and (not text.strip() or text.lstrip().startswith("{")):
        return 0
    for marker in _MARKERS:
        if marker in text:
            return text.index(marker)
    for size in range(min(len(text), max(map(len, _MARKERS))), 0, -1):
        if any(m.startswith(text[-size:]) for m in _MARKERS):
            return len(text) - size
    return len(text)
