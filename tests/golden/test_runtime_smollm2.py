"""Golden: the runtime's continuous batching on SmolLM2-135M (fp32 engine) vs transformers.

32 prompts of 5 to ~1,500 tokens, submitted at staggered steps, must produce transformers'
greedy continuation (64 tokens, one prompt at a time) - with a roomy KV pool, and with a
pool too small for all of them at once (preemptions > 0, every block free at the end).
A shared 300-token system prompt is prefilled once: the second request computes only its
own tokens, with the same output as without the cache.

A divergence is accepted only at a near-tie of transformers' own logits (top-2 gap below
TIE_GAP), where fp32 summation order legitimately decides; anything else fails.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from pathlib import Path

import pytest

from kiln.runtime import RuntimeConfig, SamplingParams
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.outputs import merge_outputs

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
TIE_GAP = 0.02
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "golden"


def _corpus() -> str:
    """Natural English text without a download: the docs of a few standard-library modules."""
    import argparse
    import collections
    import json as json_mod
    import logging
    import pathlib
    import subprocess
    import textwrap

    parts = []
    for module in (collections, json_mod, logging, pathlib, subprocess, textwrap, argparse, inspect):
        parts.append(inspect.getdoc(module) or "")
        for name in sorted(n for n in dir(module) if not n.startswith("_")):
            doc = inspect.getdoc(getattr(module, name))
            if doc and len(doc) > 200 and doc not in parts:
                parts.append(doc)
    return "\n\n".join(parts)


def _prompt_lengths() -> list[int]:
    # 5 .. 1,500 tokens, mostly short (5,410 in all), in a shuffled (deterministic) order
    lengths = [round(5 * 300 ** ((i / 31) ** 2)) for i in range(32)]
    order = [(i * 13) % 32 for i in range(32)]
    return [lengths[i] for i in order]


@pytest.fixture(scope="module")
def engine_dir(smollm2_engine) -> Path:
    return smollm2_engine


@pytest.fixture(scope="module")
def prompts(engine_dir) -> list[list[int]]:
    from kiln.runtime.tokenizer import Tokenizer

    ids = Tokenizer(engine_dir).encode(_corpus())
    assert len(ids) > 4000
    return [ids[(97 * i) % 2000:(97 * i) % 2000 + n] for i, n in enumerate(_prompt_lengths())]


class HFReference:
    """transformers' SmolLM2 (from the same GGUF), greedy, one prompt at a time; cached on disk."""

    def __init__(self) -> None:
        self.model = None

    def _load(self):
        if self.model is None:
            torch = pytest.importorskip("torch")
            transformers = pytest.importorskip("transformers")
            from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

            from kiln.export.checkpoint import default_model_path

            # transformers' own GGUF path (its config, tensor mapping and q/k un-permutation);
            # from_pretrained(gguf_file=) does the same but needs accelerate.
            gguf = default_model_path()
            torch.set_num_threads(1)  # OpenMP sync of 2 threads is slow on a busy 2-core machine
            config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
            model.load_state_dict(tensors, strict=False)
            model.tie_weights()
            self.model = model
        return self.model

    def greedy(self, prompts: list[list[int]]) -> list[list[int]]:
        key = hashlib.sha256(json.dumps([prompts, NEW_TOKENS]).encode()).hexdigest()[:16]
        path = CACHE / f"smollm2-greedy-{key}.json"
        if path.is_file():
            return json.loads(path.read_text())
        import torch

        model = self._load()
        outs = []
        for p in prompts:
            with torch.no_grad():
                ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(outs))
        return outs

    def top2_gap(self, tokens: list[int]) -> float:
        import torch

        with torch.no_grad():
            logits = self._load()(torch.tensor([tokens])).logits[0, -1]
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])


@pytest.fixture(scope="session")
def hf():
    return HFReference()


@pytest.fixture(scope="module")
def reference(hf, prompts):
    return hf.greedy(prompts)


def assert_same(hf: HFReference, prompt: list[int], got: list[int], want: list[int]) -> None:
    if got == want:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)  # one may stop earlier
    gap = hf.top2_gap(prompt + want[:i])
    assert gap < TIE_GAP, f"diverges at new token {i}: kiln {got[i]} vs transformers {want[i]} (top-2 gap {gap:.4f})"


def run_staggered(engine: Engine, prompts: list[list[int]], per_step: int = 2) -> list[list[int]]:
    """Submit per_step requests before each step, so arrivals interleave with running sequences."""
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for i, p in pending[:per_step]:
            engine.add_request(f"g{i}", p, GREEDY)
        pending = pending[per_step:]
        for out in engine.step():  # deltas: each step's new tokens
            results.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        engine.block_manager.check()
    return [results[f"g{i}"] for i in range(len(prompts))]


def test_staggered_batch_matches_transformers(engine_dir, prompts, reference, hf):
    engine = load_engine(engine_dir, RuntimeConfig(kv_cache_bytes=1 << 30, max_num_seqs=32))
    t = time.perf_counter()
    got = run_staggered(engine, prompts)
    print(f"kiln: {len(prompts)} prompts in {time.perf_counter() - t:.1f}s, {engine.stats()}")
    for p, g, w in zip(prompts, got, reference, strict=True):
        assert_same(hf, p, g, w)
    assert engine.block_manager.num_used_blocks == 0


def test_small_pool_preempts_without_changing_outputs(engine_dir, prompts, reference, hf):
    engine = load_engine(engine_dir, RuntimeConfig(kv_cache_bytes=128 * 737280, max_num_seqs=32))
    assert engine.block_manager.num_blocks == 128  # 2,048 tokens for 5,410 prompt + 2,048 new
    got = run_staggered(engine, prompts, per_step=4)
    stats = engine.stats()
    print(f"small pool: {stats}")
    assert stats.num_preemptions > 0
    for p, g, w in zip(prompts, got, reference, strict=True):
        assert_same(hf, p, g, w)
    assert stats.kv_blocks_used == 0 and not engine.block_manager.owners
    engine.block_manager.check()


def test_shared_system_prompt_is_prefilled_once(engine_dir):
    from kiln.runtime.tokenizer import Tokenizer

    tok = Tokenizer(engine_dir)
    system = tok.encode(_corpus())[:300]
    first, second = system + tok.encode(" First question: what is JSON?"), system + tok.encode(" Second: logging?")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    warm = load_engine(engine_dir, RuntimeConfig(kv_cache_bytes=64 << 20, max_model_len=1024))
    outs = []
    for i, p in enumerate((first, second)):
        before = warm.stats().num_prompt_tokens_computed
        warm.add_request(f"s{i}", p, params)
        deltas = []
        while warm.has_unfinished():
            deltas += warm.step()
        outs.append(merge_outputs(deltas))
        computed = warm.stats().num_prompt_tokens_computed - before
    assert outs[1].num_cached_tokens == 288  # 18 full blocks of the shared 300 tokens
    assert computed == len(second) - 288
    cold = load_engine(engine_dir, RuntimeConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False,
                                                 max_model_len=1024))
    cold.add_request("c", second, params)
    deltas = []
    while cold.has_unfinished():
        deltas += cold.step()
    cold_out = merge_outputs(deltas)
    assert cold_out.outputs[0].token_ids == outs[1].outputs[0].token_ids
