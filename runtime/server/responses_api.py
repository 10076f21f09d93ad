"""POST /v1/responses (OpenAI's Responses API, the Agents SDK's default) over the chat path: the request's input
items become chat messages (function_call items an assistant's tool_calls, function_call_output items tool
messages), its flat tools and text.format the chat request's tools and response_format; the chat answer becomes
output items (a message with output_text, then function_call items). Stateless: previous_response_id is refused
(kiln stores no responses), and so is stream (not implemented for this endpoint)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.errors import InvalidParamError
from kiln.runtime.server.protocol import ChatCompletionRequest


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="Text, or a list of input items (messages, "
                                                          "function_call, function_call_output).")
    instructions: str | None = Field(None, description="A system message put first.")
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools: {type, name, parameters, ...}.")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description="{'format': {'type': 'text' | 'json_object' | "
                                                          "'json_schema', 'schema': ..., 'strict': ...}}")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    previous_response_id: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat completions request; InvalidParamError naming this request's field."""
        if self.stream:
            raise InvalidParamError("stream is not supported on /v1/responses by kiln; use /v1/chat/completions "
                                    "to stream", "stream")
        if self.previous_response_id is not None:
            raise InvalidParamError("previous_response_id is not supported: kiln stores no responses; send the "
                                    "whole conversation as input", "previous_response_id")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": False}
        for name in ("temperature", "top_p", "seed", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if isinstance(self.tool_choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.get("name")}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _chat_format(fmt)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = _responses_param(".".join(str(p) for p in first["loc"]))
            raise InvalidParamError(f"{param}: {first['msg']}", param) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": _text(item.get("output"), i)})
            else:
                raise InvalidParamError(f"input.{i}.type {kind!r} is not supported (message, function_call, "
                                        "function_call_output)", f"input.{i}.type")
        return messages


def _responses_param(chat_param: str) -> str:
    """A chat request's field path as the Responses request spells it."""
    for chat, responses in (("messages", "input"), ("response_format", "text.format"), ("max_completion_tokens",
                            "max_output_tokens"), ("function.", "")):
        chat_param = chat_param.replace(chat, responses)
    return chat_param


def _text(content: Any, index: int) -> str:
    """A message's content: a string, or input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidParamError(f"input.{index}.content must be a string or a list of text parts", f"input.{index}.content")


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidParamError(f"tools.{index}.type must be 'function' (kiln runs no hosted tools), got "
                                f"{tool.get('type')!r}", f"tools.{index}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt.get("type")}


def response_body(chat: dict[str, Any], request: ResponsesRequest) -> dict[str, Any]:
    """The Responses API object for a finished chat completion body."""
    choice = chat["choices"][0]
    message, reason = choice["message"], choice["finish_reason"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = chat["usage"]
    incomplete = reason == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "model": chat["model"], "output": output, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls is not False, "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [], "text": request.text or {"format": {"type": "text"}}, "metadata": {},
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"],
                  "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }
