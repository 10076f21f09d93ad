"""Tensor-parallel ranks on SmolLM2-135M fp32 (the cached test engine split in 2 and 3 ranks: 9 query heads in 3 KV
groups, so 3 ranks hold one KV head each and 2 ranks hold 1 and 2): logits within 1e-4 of the one graph, and greedy
tokens identical under continuous batching with preemption and prefix caching, one process and one thread per
rank. (An int4-q4_1 engine's ranks are not token-identical to its one graph: its activations' int8 rounding turns
the all-reduce's float reordering into differences of the scheme's own noise; docs/design.md.)"""

import pytest
from pipeline_helpers import staggered_greedy, step_logits

from kiln.manifest import read_manifest
from kiln.optimize.shard_tensor_parallel import split_engine_tensor_parallel
from kiln.runtime.params import RuntimeConfig
from kiln.runtime.tokenizer import Tokenizer

SYSTEM = "You are a careful assistant. Answer in one short paragraph, and say when you do not know. "
QUESTIONS = ["What is a paged KV cache?", "Why is the sky blue?", "Name three prime numbers.", "What is JSON?",
             "How do bees make honey?", "What is a compiler?", "Explain recursion.", "What is 17 times 3?"]


@pytest.fixture(scope="module")
def engines(smollm2_engine, tmp_path_factory):
    """The one-graph fp32 engine and its copies split in 2 and 3 ranks."""
    root = tmp_path_factory.mktemp("tp-smollm2")
    for count in (2, 3):
        split_engine_tensor_parallel(smollm2_engine, root / str(count), count)
    return {1: smollm2_engine, 2: root / "2", 3: root / "3"}


@pytest.fixture(scope="module")
def prompts(smollm2_engine):
    tokenizer = Tokenizer(smollm2_engine)
    return [tokenizer.encode(SYSTEM + question) for question in QUESTIONS]


@pytest.fixture(scope="module")
def config(engines):
    """A pool of 14 blocks: preemption under the staggered arrivals."""
    block_bytes = read_manifest(engines[1]).spec.num_layers * 2 * 3 * 16 * 64 * 4  # float32 KV
    return RuntimeConfig(num_threads=1, kv_cache_bytes=14 * block_bytes, max_model_len=160)


@pytest.fixture(scope="module")
def one_graph(engines, prompts, config):
    """The one graph's greedy tokens and step logits, computed once for every rank count."""
    return staggered_greedy(engines[1], prompts, config)[0], step_logits(engines[1], prompts[:3])


def test_the_ranks_hold_whole_kv_groups(engines):
    for count, kv_heads in ((2, [1, 2]), (3, [1, 1, 1])):
        ranks = read_manifest(engines[count]).ranks
        assert [len(r.kv_heads) for r in ranks] == kv_heads
        assert [len(r.heads) for r in ranks] == [3 * k for k in kv_heads]
        assert sum(len(r.columns) for r in ranks) == 1536 and all(len(r.columns) % 32 == 0 for r in ranks)


@pytest.mark.parametrize("ranks", [2, 3])
def test_greedy_under_preemption_and_prefix_caching_is_token_identical(engines, prompts, config, one_graph, ranks):
    want = one_graph[0]
    got, stats = staggered_greedy(engines[ranks], prompts, config)
    assert got == want
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_blocks_used == 0


@pytest.mark.parametrize("ranks", [2, 3])
def test_fp32_rank_logits_within_1e4(engines, prompts, one_graph, ranks):
    want_prefill, want_decode = one_graph[1]
    got_prefill, got_decode = step_logits(engines[ranks], prompts[:3])
    assert abs(got_prefill - want_prefill).max() <= 1e-4 and abs(got_decode - want_decode).max() <= 1e-4
