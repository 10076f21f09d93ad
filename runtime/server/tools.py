"""Tool calling for /v1/chat/completions: the request's tools validated, and the model's calls turned into OpenAI's
`tool_calls` (whole, or as stream deltas). The prompt, the constraint that forces a call and the parsers of each
family's call syntax are the runtime's (runtime/tool_calls.py), shared with LLM.chat(tools=...).

tool_choice: "none" sends no tools and parses nothing; "auto" lets the model answer or call, and parses its
text; "required" constrains the output to a JSON array of calls (one call when parallel_tool_calls is false);
a named function constrains it to that function's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.errors import InvalidParamError
from kiln.runtime.structured import StructuredOutput
from kiln.runtime.tool_calls import MARKERS, check_tools, forced_call, hermes_messages, make_call, parse_output


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


@dataclass(frozen=True)
class ToolMode:
    """How one request's output relates to its tools (made by tool_mode)."""

    tools: tuple[Tool, ...]
    choice: Literal["auto", "required", "named"]
    name: str | None = None  # the named function
    parallel: bool = True

    def dicts(self) -> list[dict[str, Any]]:
        """The tools as OpenAI's dicts (what a template and runtime/tool_calls.py take)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> StructuredOutput | None:
        """The grammar that forces the call(s): None for auto."""
        return forced_call(self.dicts(), self.choice, self.name, self.parallel)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls as OpenAI tool_calls) of a finished output."""
        return parse_output(text, self.dicts(), self.choice, self.name)


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolMode | None:
    """The request's tool mode; None when it sends no tools or tool_choice is "none"."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidParamError("tool_choice needs tools", "tool_choice")
        return None
    check_tools([t.model_dump(exclude_none=True) for t in tools])
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

def render_messages(messages: list[Any], mode: ToolMode | None) -> list[dict[str, str]]:
    """The conversation as a template without tools reads it (runtime/tool_calls.hermes_messages)."""
    dicts = [{**m.as_dict(), "tool_calls": [c.model_dump() for c in m.tool_calls or ()]} for m in messages]
    return hermes_messages(dicts, None if mode is None else mode.dicts())


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
                call = {**make_call(self.mode.name or "", text), "index": 0}
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
    return any(text.startswith(m) for m in MARKERS) or (at_start and text.lstrip().startswith("{"))


def _safe_prefix(text: str, at_start: bool) -> int:
    """How much of text may be sent as content now: up to a call marker, or up to a suffix that could still
    become one; nothing while the output so far is blank or a JSON object's start (a Llama 3 call)."""
    if at_start and (not text.strip() or text.lstrip().startswith("{")):
        return 0
    for marker in MARKERS:
        if marker in text:
            return text.index(marker)
    for size in range(min(len(text), max(map(len, MARKERS))), 0, -1):
        if any(m.startswith(text[-size:]) for m in MARKERS):
            return len(text) - size
    return len(text)
