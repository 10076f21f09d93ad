"""LLM: the synchronous Python API (batch generation over continuous batching)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kiln.errors import InvalidParamError
from kiln.runtime.detokenizer import ChatMessage, TextTokenizer, with_token_text
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.outputs import CompletionOutput, EngineStats, RequestOutput, merge_outputs
from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.runtime.tool_calls import check_tools, forced_call, hermes_messages, loads_arguments, parse_output, tool_name
from kiln.runtime.vision.chat import split_images

if TYPE_CHECKING:
    from PIL.Image import Image

Prompt = str | list[int]
Prompts = Prompt | list[str] | list[list[int]]  # one prompt (text or token ids) or a list of them


def as_engine(engine: str | Path | Engine, config: RuntimeConfig | None) -> Engine:
    """An Engine given as itself (e.g. one over a fake runner, in tests) or as an engine dir to load."""
    if isinstance(engine, Engine):
        if config is not None:
            raise ValueError("config must be None when an already built Engine is given")
        return engine
    return load_engine(engine, config)


def _normalize_prompts(prompts: Prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt of token ids
        return [list(cast(list[int], prompts))]
    return list(cast(list[Prompt], prompts))


def _normalize_params(params: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"params has {len(params)} entries but there are {n} prompts")
    return params


class LLM:
    def __init__(self, engine: str | Path | Engine, config: RuntimeConfig | None = None) -> None:
        """engine: an engine directory (loaded with config) or an already built Engine."""
        self.engine = as_engine(engine, config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.engine.tokenizer

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self, prompts: Prompts, params: SamplingParams | list[SamplingParams] | None = None,
        images: list[list[Image]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (all batched together); whole results, in prompt order. images: a
        vision-language engine's images, a list per prompt (one per image placeholder in it)."""
        prompt_list = _normalize_prompts(prompts)
        param_list = _normalize_params(params, len(prompt_list))
        image_lists = images if images is not None else [[] for _ in prompt_list]
        if len(image_lists) != len(prompt_list):
            raise ValueError(f"images has {len(image_lists)} lists but there are {len(prompt_list)} prompts")
        # Prepare every request before anything runs, so bad input is rejected with nothing queued.
        requests = [
            self.engine.prepare(f"llm-{next(self._ids)}", prompt, p, pictures)
            for prompt, p, pictures in zip(prompt_list, param_list, image_lists, strict=True)
        ]
        deltas: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        results: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                self.engine.add(request)
            while len(results) < len(requests):
                for output in self.engine.step():
                    deltas[output.request_id].append(output)
                    if output.finished:
                        results[output.request_id] = merge_outputs(deltas.pop(output.request_id))
        finally:
            for request_id in deltas:
                self.engine.abort(request_id)
        return [with_token_text(self.tokenizer, results[r.request_id]) for r in requests]

    def chat(
        self, messages: list[ChatMessage] | list[list[ChatMessage]],
        params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] = "auto",
    ) -> list[RequestOutput]:
        """Apply the engine's chat template to one conversation or a list of them, then generate. A message's
        content may be a list of OpenAI content parts: text, and on a vision-language engine images
        (``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, a ``file://`` URL inside
        RuntimeConfig.allowed_media_path, or ``{"type": "image", "image": <PIL image>}``).

        tools: OpenAI's function tools ({"type": "function", "function": {"name", "parameters", ...}}), offered to
        every conversation (runtime/tool_calls.py): a template that takes tools gets them, any other the Hermes
        prompt. tool_choice: "auto" (the model's own calls are parsed), "required" (the output is forced to a
        JSON array of calls), {"type": "function", "function": {"name": ...}} (forced to that function's
        arguments) or "none". Each sample's calls come back as CompletionOutput.tool_calls, its text unchanged.
        The history may hold assistant messages with "tool_calls" and "tool" messages with the results."""
        if messages and isinstance(messages[0], dict):  # one conversation
            conversations = [messages]
        else:
            conversations = list(cast(list[list[ChatMessage]], messages))
        media_dir = self.engine.config.media_dir()
        split = [split_images(c, self.engine.image_placeholder, media_dir) for c in conversations]
        images = [found for _, found in split]
        choice, name = _tool_choice(tools, tool_choice)
        if choice is None:
            prompts = [self.tokenizer.apply_chat_template(self._conversation(c, None)) for c, _ in split]
            return self.generate(prompts, params, images)
        assert tools is not None
        prompts = [self._render_with_tools(c, tools) for c, _ in split]
        forced = forced_call(tools, choice, name)
        param_list = _normalize_params(params, len(prompts))
        if forced is not None:
            if any(p.structured is not None for p in param_list):
                raise InvalidParamError("a forced tool call (tool_choice required or a function) cannot also have "
                                        "an output constraint", "tool_choice")
            param_list = [dataclasses.replace(p, structured=forced) for p in param_list]
        results = self.generate(prompts, param_list, images)
        return [dataclasses.replace(r, outputs=[_with_calls(o, tools, choice, name) for o in r.outputs])
                for r in results]

    def _conversation(self, conversation: list[ChatMessage], tools: list[dict[str, Any]] | None) -> list[ChatMessage]:
        """The conversation as this template reads it: as given to one that takes tools, else Hermes-style."""
        if self.tokenizer.tool_family is not None:
            return conversation
        has_calls = any(m.get("tool_calls") or m.get("role") == "tool" for m in conversation)
        return list(hermes_messages(conversation, tools)) if tools or has_calls else conversation

    def _render_with_tools(self, conversation: list[ChatMessage], tools: list[dict[str, Any]]) -> str:
        if self.tokenizer.tool_family is not None:  # Hugging Face's templates write the arguments with tojson
            native = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": loads_arguments(
                c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in conversation]
            return self.tokenizer.apply_chat_template(native, tools=tools)
        return self.tokenizer.apply_chat_template(self._conversation(conversation, tools))


def _tool_choice(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any]) -> tuple[str | None, str | None]:
    """(one of tool_calls.CHOICES or None for no tools, the named function). InvalidParamError names the field."""
    if not tools:
        if choice not in ("auto", "none"):
            raise InvalidParamError("tool_choice needs tools", "tool_choice")
        return None, None
    check_tools(tools)
    if choice == "none":
        return None, None
    if choice in ("auto", "required"):
        return str(choice), None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in {tool_name(t) for t in tools}:
        raise InvalidParamError(f"tool_choice must be 'auto', 'required', 'none' or {{'type': 'function', "
                                f"'function': {{'name': ...}}}} naming one of the tools, got {choice!r}",
                                "tool_choice")
    return "named", str(name)


def _with_calls(out: CompletionOutput, tools: list[dict[str, Any]], choice: str,
                name: str | None) -> CompletionOutput:
    _, calls = parse_output(out.text, tools, choice, name)
    return dataclasses.replace(out, tool_calls=calls or None)
