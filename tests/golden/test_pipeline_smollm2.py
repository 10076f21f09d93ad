"""Pipeline stages on SmolLM2-135M (fp32 and int4-q4_1, the cached test engines split in 2 and 3 stages): fp32
logits within 1e-4 of the one graph, and greedy tokens identical under continuous batching with preemption and
prefix caching, one thread per stage, each step whole or in micro-batches of whole sequences."""

import dataclasses

import pytest
from pipeline_helpers import staggered_greedy, step_logits

from kiln.manifest import read_manifest
from kiln.optimize.split_stages import split_engine
from kiln.runtime.params import RuntimeConfig
from kiln.runtime.tokenizer import Tokenizer

SYSTEM = "You are a careful assistant. Answer in one short paragraph, and say when you do not know. "
QUESTIONS = ["What is a paged KV cache?", "Why is the sky blue?", "Name three prime numbers.", "What is JSON?",
             "How do bees make honey?", "What is a compiler?", "Explain recursion.", "What is 17 times 3?"]


@pytest.fixture(scope="module", params=["fp32", "int4-q4_1"])
def engines(request, tmp_path_factory):
    """The one-graph engine and its copies split in 2 and 3 stages."""
    one = request.getfixturevalue("smollm2_engine" if request.param == "fp32" else "smollm2_q4_1_engine")
    root = tmp_path_factory.mktemp(f"staged-{request.param}")
    for count in (2, 3):
        split_engine(one, root / str(count), count)
    return {1: one, 2: root / "2", 3: root / "3"}


@pytest.fixture(scope="module")
def prompts(smollm2_engine):
    tokenizer = Tokenizer(smollm2_engine)
    return [tokenizer.encode(SYSTEM + question) for question in QUESTIONS]


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 1), (3, 3)])
def test_greedy_under_preemption_and_prefix_caching_is_token_identical(engines, prompts, stages, micro_batches):
    block_bytes = read_manifest(engines[1]).spec.num_layers * 2 * 3 * 16 * 64  # x KV bytes per element
    element = 4 if read_manifest(engines[1]).build.kv_dtype == "float32" else 2
    config = RuntimeConfig(num_threads=1, kv_cache_bytes=14 * block_bytes * element, max_model_len=160)
    want, _ = staggered_greedy(engines[1], prompts, config)
    got, stats = staggered_greedy(engines[stages], prompts,
                                  dataclasses.replace(config, pipeline_micro_batches=micro_batches))
    assert got == want
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_blocks_used == 0


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 2), (3, None)])
def test_fp32_stage_logits_within_1e4(engines, prompts, stages, micro_batches):
    if read_manifest(engines[1]).build.quantization.name != "none":
        pytest.skip("the logits bound is the fp32 engine's")
    want_prefill, want_decode = step_logits(engines[1], prompts[:3])
    got_prefill, got_decode = step_logits(engines[stages], prompts[:3], micro_batches)
    assert abs(got_prefill - want_prefill).max() <= 1e-4 and abs(got_decode - want_decode).max() <= 1e-4
