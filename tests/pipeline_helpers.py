"""Drivers shared by the pipeline tests (tiny engine and SmolLM2): a staggered run under preemption and prefix
caching, and the logits of one packed prefill + decode batch, for a one-graph engine and its staged copies."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.manifest import read_manifest
from kiln.runtime.loader import load_engine, open_engine_runner
from kiln.runtime.model_runner import Chunk, pack_chunks
from kiln.runtime.params import RuntimeConfig, SamplingParams


def staggered_greedy(engine_dir: Path, prompts: list[list[int]], config: RuntimeConfig, max_tokens: int = 24):
    """Greedy tokens of each prompt, one arrival per step (continuous batching), the block manager's invariants
    checked after every step; (tokens per prompt, engine stats)."""
    engine = load_engine(engine_dir, config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        engine.block_manager.check()
    stats = engine.stats()
    engine.runner.close()
    return [tokens[str(i)] for i in range(len(prompts))], stats


def step_logits(engine_dir: Path, prompts: list[list[int]],
                micro_batches: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Logits of every row of one packed prefill of the prompts, then of one decode token each (1 thread; a staged
    engine's steps as micro_batches micro-batches)."""
    manifest = read_manifest(engine_dir)
    blocks_each = -(-(max(map(len, prompts)) + 1) // manifest.build.block_size)
    runner = open_engine_runner(engine_dir, manifest, blocks_each * len(prompts), 1, micro_batches)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompts))]
    prefill = runner.execute(pack_chunks([Chunk(0, p, t) for p, t in zip(prompts, tables, strict=True)], True))
    decode = runner.execute(pack_chunks([Chunk(len(p), [p[0]], t) for p, t in zip(prompts, tables, strict=True)],
                                        False))
    runner.close()
    return prefill, decode
