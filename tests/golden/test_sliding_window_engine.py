"""Golden: a sliding-window model served past its window, with the KV blocks behind the window released.

A tiny Mistral (transformers' own class, sliding_window 16, fp32) is built and served through the whole
runtime (scheduler, block manager, ONNX Runtime op) with a KV pool of six blocks (96 tokens) and 32-token
steps: prompts of 40-100 tokens prefill in chunks and decode 30 tokens more, so every sequence outgrows the
pool and runs only because the blocks behind its window go back (and other sequences reuse them). Every
generated token's top logprobs must equal transformers' eager model on the whole sequence, and greedy
decoding must pick the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

WINDOW = 16
PROMPT_LENGTHS = (40, 70, 100)
NEW_TOKENS = 30


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from helpers import make_tiny_hf_model

    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    tmp = tmp_path_factory.mktemp("mistral-window")
    model = make_tiny_hf_model(tmp, family="mistral", sliding_window=WINDOW)
    build_engine(model, tmp / "engine", BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    return model, tmp / "engine"


def test_decode_past_the_window_in_a_pool_shorter_than_a_sequence(mistral):
    from transformers import AutoModelForCausalLM

    from kiln.manifest import read_manifest
    from kiln.runtime.block_manager import RELEASED
    from kiln.runtime.llm import LLM
    from kiln.runtime.loader import engine_kv_pools
    from kiln.runtime.params import RuntimeConfig, SamplingParams

    model_dir, engine_dir = mistral
    block_bytes = engine_kv_pools(read_manifest(engine_dir)).bytes_per_block
    llm = LLM(engine_dir, RuntimeConfig(kv_cache_bytes=6 * block_bytes, max_num_tokens=32))
    engine = llm.engine
    assert engine.runner.num_blocks == 6 and engine.block_manager.sliding_window == WINDOW
    assert engine.max_seq_len == read_manifest(engine_dir).max_seq_len  # any length: a sequence holds its window

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n).tolist() for n in PROMPT_LENGTHS]
    released = []
    original_commit = engine.block_manager.commit

    def commit(seq):  # watch the tables as the steps go by
        original_commit(seq)
        released.append(seq.block_table.count(RELEASED))

    engine.block_manager.commit = commit
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5))
    assert max(released) >= (max(PROMPT_LENGTHS) + NEW_TOKENS - WINDOW) // 16 - 1
    assert engine.peak_blocks_used <= 6 < -(-(max(PROMPT_LENGTHS) + NEW_TOKENS) // 16)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        sample = output.outputs[0]
        tokens = prompt + sample.token_ids
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([tokens[:-1]])).logits[0]
        want = torch.log_softmax(logits[len(prompt) - 1:], dim=-1).numpy()  # the row before each new token
        assert sample.token_ids == want.argmax(axis=-1).tolist(), f"prompt of {len(prompt)}: greedy tokens differ"
        assert sample.logprobs is not None
        for i, top in enumerate(sample.logprobs):
            got = np.array([lp.logprob for lp in top.values()])
            err = np.abs(got - want[i, list(top)]).max()
            assert err <= 1e-4, f"prompt of {len(prompt)}, token {i}: max |logprob - transformers| = {err:.2e}"
