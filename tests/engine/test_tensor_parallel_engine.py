"""Tensor-parallel ranks on a tiny random 4-layer llama (4 query heads, 2 KV heads): kiln build --tensor-parallel 2
writes one graph per rank, split_engine_tensor_parallel does the same to the built engine (4 ranks: each KV head
held by two ranks) and to an int4-q4_1 build (within the scheme's own noise of its one graph), and the ranks, one
process and one thread each, generate what the one graph does (logits within 1e-4, greedy tokens identical) under
continuous batching with preemption and prefix caching; the all-reduce's bytes and waits are counted per rank; a
rank killed under running requests fails them with KvLostError's message and the restarted ranks serve the next
ones; bad rank counts fail with one sentence."""

import os
import signal

import numpy as np
import onnx
import pytest
from pipeline_helpers import staggered_greedy, step_logits
from q4_1_records_helpers import assert_records_compute_the_blocks_logits, assert_records_on_pages

from kiln.all_reduce import WORKSPACE_INPUT
from kiln.manifest import BuildOptions, EngineLoadError, read_manifest
from kiln.optimize.build import BuildError, build_engine
from kiln.optimize.shard_tensor_parallel import split_engine_tensor_parallel
from kiln.quant_scheme import QuantScheme
from kiln.runtime.model_runner import Chunk, pack_chunks
from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.tensor_parallel import TP_HIDDEN

LAYERS = 4
PROMPTS = [[(13 * i + 7 * j) % 280 + 5 for j in range(6 + 5 * i)] for i in range(3)]
SHARED = [(11 * j) % 250 + 9 for j in range(20)]  # more than one 16-token block: a prefix-cache hit
STAGGERED = [SHARED + [(5 * i + j) % 200 + 3 for j in range(4 + 3 * i)] for i in range(7)]


@pytest.fixture(scope="module")
def tiny4_model(tmp_path_factory):
    from helpers import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny4"), family="llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny4_model):
    """The one-graph engine, the same model built with --tensor-parallel 2, the one graph split in 4 ranks, and an
    int4-q4_1 build of the model ("q4") with its split in 2 ("q4-2")."""
    root = tmp_path_factory.mktemp("tiny4-tp")
    quiet = {"progress": lambda _message: None}
    build_engine(tiny4_model, root / "one", BuildOptions(kv_dtype="float32"), **quiet)
    build_engine(tiny4_model, root / "two", BuildOptions(kv_dtype="float32", tensor_parallel=2), **quiet)
    split_engine_tensor_parallel(root / "one", root / "four", 4)
    q4 = BuildOptions(kv_dtype="float32", quantization=QuantScheme.parse("int4-q4_1"))
    build_engine(tiny4_model, root / "q4", q4, **quiet)
    split_engine_tensor_parallel(root / "q4", root / "q4-2", 2)
    return {1: root / "one", 2: root / "two", 4: root / "four", "q4": root / "q4", "q4-2": root / "q4-2"}


def test_each_rank_graph_has_its_heads_pools_and_all_reduces(engines):
    manifest = read_manifest(engines[4])
    assert [(r.first_head, r.end_head, r.first_kv_head, r.end_kv_head) for r in manifest.ranks] == \
        [(0, 1, 0, 1), (1, 2, 0, 1), (2, 3, 1, 2), (3, 4, 1, 2)]  # 4 ranks over 2 KV heads: each held twice
    assert sum(len(r.columns) for r in manifest.ranks) == manifest.spec.intermediate_size
    assert read_manifest(engines[2]).build.tensor_parallel == 2 and not (engines[2] / "model.onnx").exists()
    for index, rank in enumerate(manifest.ranks):
        graph = onnx.load(str(engines[4] / rank.graph), load_external_data=False).graph
        inputs = {i.name: i for i in graph.input}
        outputs = {o.name for o in graph.output}
        assert inputs["kv_cache.0"].type.tensor_type.shape.dim[2].dim_value == 1 and WORKSPACE_INPUT in inputs
        assert ("logits" in outputs) == (index == 0) and (TP_HIDDEN in outputs) == (index > 0)
        reduces = [n for n in graph.node if n.op_type == "AllReduce"]
        assert len(reduces) == 2 * LAYERS
        attention = [n for n in graph.node if n.op_type == "PagedAttention"]
        assert {a.name: a.i for a in attention[0].attribute if a.name in ("num_heads", "num_kv_heads")} == \
            {"num_heads": 1, "num_kv_heads": 1}


@pytest.mark.parametrize("ranks", [2, 4])
def test_rank_logits_match_the_one_graph(engines, ranks):
    want_prefill, want_decode = step_logits(engines[1], PROMPTS)
    got_prefill, got_decode = step_logits(engines[ranks], PROMPTS)
    np.testing.assert_allclose(got_prefill, want_prefill, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got_decode, want_decode, rtol=0, atol=1e-4)


def test_q4_1_ranks_stay_within_the_schemes_own_noise(engines):
    """int4-q4_1 ranks (kiln.MatMulQ4_1 weights sliced by channel and by whole blocks) are not bit-exact: the
    all-reduce adds in another order than one MatMul, and the kernel's int8 rounding of activations turns that
    into a flipped step here and there. Their logits must stay far closer to the one q4 graph than that graph is
    to float32 (a wrong slice lands at the float32 distance or beyond)."""
    q4 = np.concatenate(step_logits(engines["q4"], PROMPTS))
    ranks = np.concatenate(step_logits(engines["q4-2"], PROMPTS))
    fp32 = np.concatenate(step_logits(engines[1], PROMPTS))
    assert abs(ranks - q4).mean() < 0.1 * abs(q4 - fp32).mean()
    assert (ranks.argmax(-1) == q4.argmax(-1)).mean() >= 0.9


def test_q4_1_engine_and_its_ranks_hold_records(engines, tmp_path):
    """The int4-q4_1 build stores the kernel's records (the blocks' logits bit for bit), and its ranks' slices of
    them are records again."""
    assert_records_compute_the_blocks_logits(engines["q4"], tmp_path)
    for rank in read_manifest(engines["q4-2"]).ranks:
        assert_records_on_pages(engines["q4-2"] / rank.graph)


def test_greedy_under_preemption_and_prefix_caching_is_token_identical(engines):
    config = RuntimeConfig(num_threads=1, kv_cache_bytes=12 * 16384, max_model_len=96)
    want, _ = staggered_greedy(engines[1], STAGGERED, config)
    got, stats = staggered_greedy(engines[2], STAGGERED, config)
    assert got == want
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_blocks_used == 0
    ranks = stats.tensor_parallel
    assert len(ranks.rank_seconds) == 2 and all(s > 0 for s in ranks.rank_seconds) and ranks.restarts == 0


def test_rank_totals_count_the_all_reduced_bytes(engines):
    from kiln.runtime.loader import open_engine_runner

    manifest = read_manifest(engines[2])
    runner = open_engine_runner(engines[2], manifest, 4, 1)
    try:
        runner.execute(pack_chunks([Chunk(0, PROMPTS[1], [0, 1])], False))
        totals = runner.rank_totals()
    finally:
        runner.close()
    # two all-reduces per layer of [tokens, hidden] float32, on each of the 2 ranks
    assert totals.all_reduce_bytes == 2 * 2 * LAYERS * len(PROMPTS[1]) * manifest.spec.hidden_size * 4
    assert totals.steps == 1 and len(totals.wait_seconds) == 2 and all(w >= 0 for w in totals.wait_seconds)


def test_a_step_that_fails_on_the_ranks_raises_and_the_next_step_runs(engines):
    """A block id past the pools fails every rank's attention: the step raises (no rank left waiting in an
    all-reduce), and the ranks, reset, compute the next step as the one graph does."""
    from kiln.runtime.loader import open_engine_runner

    runners = [open_engine_runner(engines[n], read_manifest(engines[n]), 4, 1) for n in (1, 2)]
    good = pack_chunks([Chunk(0, PROMPTS[1], [0, 1])], False)
    try:
        with pytest.raises(RuntimeError, match="tensor-parallel rank . failed the step"):
            runners[1].execute(pack_chunks([Chunk(0, PROMPTS[1], [9])], False))
        np.testing.assert_allclose(runners[1].execute(good), runners[0].execute(good), rtol=0, atol=1e-4)
        assert runners[1].rank_totals().restarts == 0
    finally:
        for runner in runners:
            runner.close()


def test_a_killed_rank_fails_the_running_requests_and_the_restarted_ranks_serve(engines):
    from kiln.runtime.loader import load_engine

    engine = load_engine(engines[2], RuntimeConfig(num_threads=1, kv_cache_bytes=1 << 20))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        engine.add_request("a", PROMPTS[0], params)
        engine.step()
        os.kill(engine.runner.group.pids[1], signal.SIGKILL)
        errors = {out.request_id: out.error for out in engine.step()}
        assert "tensor-parallel rank 1" in (errors.get("a") or "") and "died" in errors["a"]
        assert engine.runner.rank_totals().restarts == 1 and not engine.has_unfinished()
        engine.add_request("b", PROMPTS[1], params)
        tokens = []
        while engine.has_unfinished():
            tokens += [t for out in engine.step() for t in out.outputs[0].token_ids]
    finally:
        engine.runner.close()
    want, _ = staggered_greedy(engines[1], [PROMPTS[1]], RuntimeConfig(num_threads=1, kv_cache_bytes=1 << 20),
                               max_tokens=8)
    assert tokens == want[0]


def test_a_rank_count_other_than_the_engines_is_refused(engines):
    from kiln.runtime.loader import load_engine

    with pytest.raises(EngineLoadError, match="--tensor-parallel 3 needs an engine of 3 ranks, and .* has 2 "
                                              "tensor-parallel ranks; build it with kiln build --tensor-parallel 3"):
        load_engine(engines[2], RuntimeConfig(num_threads=1, tensor_parallel=3))
    with pytest.raises(EngineLoadError, match="has one graph"):
        load_engine(engines[1], RuntimeConfig(num_threads=1, tensor_parallel=2))


def test_heads_that_do_not_split_are_refused_at_build(tiny4_model, tmp_path):
    with pytest.raises(BuildError, match="4 query heads in 2 KV groups do not split over 3 tensor-parallel ranks"):
        build_engine(tiny4_model, tmp_path / "three", BuildOptions(tensor_parallel=3), progress=lambda _m: None)


def test_kiln_split_writes_the_ranks_and_names_a_missing_count(engines, tmp_path):
    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(main, ["split", str(engines[1]), str(tmp_path / "two"), "--tensor-parallel", "2"])
    assert result.exit_code == 0, result.output
    assert "rank0.onnx, rank1.onnx" in result.output and len(read_manifest(tmp_path / "two").ranks) == 2
    result = CliRunner().invoke(main, ["split", str(engines[1]), str(tmp_path / "none")])
    assert result.exit_code != 0 and "give one of --tensor-parallel N or --pipeline-stages N" in result.output
