"""LLM: the synchronous Python API (batch generation over continuous batching)."""

from __future__ import annotations

import itertools
from pathlib import Path

from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.outputs import EngineStats, RequestOutput
from kiln.runtime.params import RuntimeConfig, SamplingParams

Prompt = str | list[int]


def _normalize_prompts(prompts: str | list[str] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt of token ids
        return [prompts]
    return prompts


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
    def __init__(self, engine_dir: str | Path, config: RuntimeConfig | None = None) -> None:
        self.engine = load_engine(engine_dir, config)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """Wrap an already built Engine (e.g. one with a fake runner, in tests)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self, prompts: str | list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (all batched together); results in prompt order."""
        prompts = _normalize_prompts(prompts)
        params = _normalize_params(params, len(prompts))
        for prompt, p in zip(prompts, params):  # reject bad input before anything runs
            self.engine.validate(prompt, p)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        results: dict[str, RequestOutput] = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p)
            while len(results) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
        finally:
            for request_id in ids:
                if request_id not in results:
                    self.engine.abort(request_id)
        return [results[i] for i in ids]

    def chat(
        self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the engine's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params)
