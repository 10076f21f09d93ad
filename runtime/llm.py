"""LLM: the synchronous Python API (batch generation over continuous batching)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, cast

from kiln.runtime.detokenizer import ChatMessage, TextTokenizer, with_token_text
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.outputs import EngineStats, RequestOutput, merge_outputs
from kiln.runtime.params import RuntimeConfig, SamplingParams
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
    ) -> list[RequestOutput]:
        """Apply the engine's chat template to one conversation or a list of them, then generate. A message's
        content may be a list of OpenAI content parts: text, and on a vision-language engine images
        (``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` or ``{"type": "image",
        "image": <PIL image>}``)."""
        if messages and isinstance(messages[0], dict):  # one conversation
            conversations = [messages]
        else:
            conversations = list(cast(list[list[ChatMessage]], messages))
        token = self.engine.image_token
        split = [split_images(c, token) for c in conversations]
        prompts = [self.tokenizer.apply_chat_template(c) for c, _ in split]
        return self.generate(prompts, params, [images for _, images in split])
