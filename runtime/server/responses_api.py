"""POST /v1/responses (OpenAI's Responses API, the Agents SDK's default) over the chat path: the request's input
items become chat messages (function_call items an assistant's tool_calls, function_call_output items tool
messages; reasoning items sent back are dropped, as chat templates drop earlier thinking), its flat tools and
text.format the chat request's tools and response_format; the chat answer becomes output items (a reasoning item
when a reasoning model thought, a message with output_text, then function_call items). With stream, the chat
stream's chunks become the Responses API's events (response.created, output items added, reasoning_text,
output_text and function-call argument deltas, items done, response.completed). Stateless: previous_response_id
is refused (kiln stores no responses)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
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
        if self.previous_response_id is not None:
            raise InvalidParamError("previous_response_id is not supported: kiln stores no responses; send the "
                                    "whole conversation as input", "previous_response_id")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream,
                                "stream_options": {"include_usage": True} if self.stream else None}
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
        if fmt is not None and not isinstance(fmt, dict):
            raise InvalidParamError("text.format must be an object such as {'type': 'json_object'}", "text.format")
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
            elif kind != "reasoning":  # earlier thinking, sent back: templates leave it out of the prompt
                raise InvalidParamError(f"input.{i}.type {kind!r} is not supported (message, function_call, "
                                        "function_call_output, reasoning)", f"input.{i}.type")
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
    if message.get("reasoning_content"):
        output.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": "completed", "summary": [],
                       "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
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
                  "output_tokens_details": {"reasoning_tokens": usage.get("completion_tokens_details", {})
                                            .get("reasoning_tokens", 0)}},
    }


class _EventStream:
    """The Responses API's server-sent events, numbered in order."""

    def __init__(self) -> None:
        self.number = 0

    def event(self, kind: str, **fields: Any) -> str:
        self.number += 1
        data = {"type": kind, "sequence_number": self.number, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def stream_events(chat_sse: AsyncIterable[str | bytes | memoryview], request: ResponsesRequest
                        ) -> AsyncIterator[str]:
    """The chat completion stream (server-sent chunks, usage included) as Responses API events: reasoning text
    and output text stream as they come (each its item, in the order the model writes them), calls at the end."""
    events, stream = _EventStream(), _StreamedItems()
    reason, usage, model = None, None, request.model or ""
    calls: dict[int, dict[str, Any]] = {}
    started, response_id = False, f"resp_{uuid.uuid4().hex}"
    async for raw in chat_sse:
        payload = (raw if isinstance(raw, str) else bytes(raw).decode()).removeprefix("data: ").strip()
        if not payload or payload == "[DONE]":
            continue
        chunk = json.loads(payload)
        if "error" in chunk:
            yield events.event("error", message=chunk["error"]["message"], code=chunk["error"].get("code"),
                               param=chunk["error"].get("param"))
            return
        model = chunk.get("model", model)
        if not started:
            started = True
            shell = {"id": response_id, "object": "response", "status": "in_progress", "model": model,
                     "output": [], "created_at": int(time.time())}
            yield events.event("response.created", response=shell)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            for kind in ("reasoning", "message"):
                text = delta.get("reasoning_content" if kind == "reasoning" else "content")
                if text:
                    for event in stream.add(kind, text, events):
                        yield event
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": call.get("id"),
                                                         "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call.get("function", {}).get("name") or ""
                entry["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
            reason = choice.get("finish_reason") or reason
    message = {"content": stream.text.get("message") or None, "reasoning_content": stream.text.get("reasoning"),
               "tool_calls": [calls[i] for i in sorted(calls)] or None}
    chat = {"model": model, "choices": [{"message": message, "finish_reason": reason}], "usage": usage}
    final = {**response_body(chat, request), "id": response_id}
    for index, item in enumerate(final["output"]):
        if item["type"] in stream.ids:
            item["id"] = stream.ids[item["type"]]
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            yield events.event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                               **({"logprobs": []} if item["type"] == "message" else {}))
            yield events.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)
        else:
            yield events.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                        "status": "in_progress"})
            yield events.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"])
            yield events.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=item["arguments"], name=item["name"])
        yield events.event("response.output_item.done", output_index=index, item=item)
    yield events.event("response.completed" if final["status"] == "completed" else "response.incomplete",
                       response=final)


class _StreamedItems:
    """The reasoning and message items a stream has opened, in order, with their text so far."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}  # item type -> id
        self.text: dict[str, str] = {}

    def add(self, kind: str, text: str, events: _EventStream) -> list[str]:
        """The events for `text` more of the item `kind` ("reasoning" or "message"), opening it first if new."""
        out = []
        index = list(self.ids).index(kind) if kind in self.ids else len(self.ids)
        if kind not in self.ids:
            self.ids[kind] = f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}"
            item: dict[str, Any] = {"type": kind, "id": self.ids[kind], "status": "in_progress", "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            if kind == "message":
                item["role"], part = "assistant", {"type": "output_text", "text": "", "annotations": []}
            else:
                item["summary"] = []
            out.append(events.event("response.output_item.added", output_index=index, item=item))
            out.append(events.event("response.content_part.added", item_id=self.ids[kind], output_index=index,
                                    content_index=0, part=part))
        self.text[kind] = self.text.get(kind, "") + text
        kind_event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        out.append(events.event(kind_event, item_id=self.ids[kind], output_index=index, content_index=0, delta=text,
                                **({"logprobs": []} if kind == "message" else {})))
        return out
