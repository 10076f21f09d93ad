"""Pipeline stages on a tiny random 4-layer llama: kiln build --pipeline-stages writes one graph per layer
range, and a staged engine generates what the one graph does (logits within 1e-4, greedy tokens identical)
under continuous batching with preemption, prefix caching and n-gram speculation; bad stage counts and
missing stage graphs fail with one sentence."""

import dataclasses
import json
import shutil

import numpy as np
import onnx
import pytest
from pipeline_helpers import staggered_greedy, step_logits

from kiln.manifest import BuildOptions, EngineLoadError, read_manifest
from kiln.optimize.build import BuildError, build_engine
from kiln.optimize.split_stages import split_engine
from kiln.pipeline_stages import HIDDEN_STATES, HIDDEN_STATES_OUT
from kiln.runtime.model_runner import Chunk, pack_chunks
from kiln.runtime.params import RuntimeConfig, SpeculativeConfig

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
    """The one-graph engine, the same model built with --pipeline-stages 2, and the one graph split in 3."""
    root = tmp_path_factory.mktemp("tiny4-engines")
    quiet = {"progress": lambda _message: None}
    build_engine(tiny4_model, root / "one", BuildOptions(kv_dtype="float32"), **quiet)
    build_engine(tiny4_model, root / "two", BuildOptions(kv_dtype="float32", pipeline_stages=2), **quiet)
    split_engine(root / "one", root / "three", 3)
    return {1: root / "one", 2: root / "two", 3: root / "three"}


def test_build_writes_one_graph_per_stage_with_its_own_pools(engines):
    manifest = read_manifest(engines[3])
    assert [(s.graph, s.first_layer, s.end_layer) for s in manifest.stages] == \
        [("stage0.onnx", 0, 2), ("stage1.onnx", 2, 3), ("stage2.onnx", 3, 4)]
    assert read_manifest(engines[2]).build.pipeline_stages == 2
    assert not (engines[2] / "model.onnx").exists() and "stage1.onnx.data" in read_manifest(engines[2]).files
    whole = (engines[1] / "model.onnx.data").stat().st_size
    for index, stage in enumerate(manifest.stages):
        graph = onnx.load(str(engines[3] / stage.graph), load_external_data=False).graph
        inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
        assert {n for n in inputs if n.startswith("kv_cache.")} == {f"kv_cache.{i}" for i in stage.layers}
        assert ("input_ids" in inputs) == (index == 0) and (HIDDEN_STATES in inputs) == (index > 0)
        assert ("logits" in outputs) == (index == 2) and (HIDDEN_STATES_OUT in outputs) == (index < 2)
        assert (engines[3] / f"{stage.graph}.data").stat().st_size < whole


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, None), (3, None), (2, 2), (3, 3)])
def test_stage_logits_match_the_one_graph(engines, stages, micro_batches):
    want_prefill, want_decode = step_logits(engines[1], PROMPTS)
    got_prefill, got_decode = step_logits(engines[stages], PROMPTS, micro_batches)
    np.testing.assert_allclose(got_prefill, want_prefill, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got_decode, want_decode, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, None), (3, None), (2, 2), (3, 4)])
def test_greedy_under_preemption_and_prefix_caching_is_token_identical(engines, stages, micro_batches):
    """Also with each step in micro-batches of whole sequences (in this process they run one after another)."""
    config = RuntimeConfig(num_threads=1, kv_cache_bytes=12 * 16384, max_model_len=96)
    want, _ = staggered_greedy(engines[1], STAGGERED, config)
    got, stats = staggered_greedy(engines[stages], STAGGERED,
                                  dataclasses.replace(config, pipeline_micro_batches=micro_batches))
    assert got == want
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_blocks_used == 0


def test_ngram_speculation_verifies_through_the_stages(engines):
    """In 2 micro-batches: a verified sequence's logits rows are several, a micro-batch's are its sequences'."""
    repetitive = [[5, 6, 7, 8] * 6 + [9 + i] for i in range(3)]
    config = RuntimeConfig(num_threads=1, kv_cache_bytes=1 << 20, speculative=SpeculativeConfig("ngram", 3),
                           pipeline_micro_batches=2)
    want, _ = staggered_greedy(engines[1], repetitive, RuntimeConfig(num_threads=1, kv_cache_bytes=1 << 20))
    got, stats = staggered_greedy(engines[3], repetitive, config)
    assert got == want and stats.num_spec_verifications > 0


def test_pipeline_stats_count_the_hidden_bytes_handed_on(engines):
    from kiln.runtime.loader import load_engine

    engine = load_engine(engines[3], RuntimeConfig(num_threads=1, kv_cache_bytes=1 << 20, pipeline_micro_batches=2))
    hidden = read_manifest(engines[3]).spec.hidden_size
    engine.runner.execute(pack_chunks([Chunk(0, PROMPTS[1], [0, 1])], False))  # one sequence: one micro-batch
    engine.runner.execute(pack_chunks([Chunk(0, PROMPTS[0], [2]), Chunk(0, PROMPTS[2], [3, 4])], False))
    stats = engine.runner.stats
    tokens = len(PROMPTS[0]) + len(PROMPTS[1]) + len(PROMPTS[2])
    assert stats.bytes_moved == 2 * tokens * hidden * 4  # two hand-offs of [tokens, hidden] float32
    assert stats.steps == 2 and stats.micro_batches == 3 and stats.tokens == tokens
    assert len(stats.stage_seconds) == 3 and all(s > 0 for s in stats.stage_seconds)


def test_more_stages_than_layers_is_refused(tiny4_model, tmp_path):
    with pytest.raises(BuildError, match=f"5 pipeline stages are more than the model's {LAYERS} layers"):
        build_engine(tiny4_model, tmp_path / "five", BuildOptions(pipeline_stages=5), progress=lambda _m: None)


def test_a_missing_stage_graph_is_a_clear_load_error(engines, tmp_path):
    from kiln.runtime.loader import load_engine

    copy = tmp_path / "engine"
    shutil.copytree(engines[2], copy)
    (copy / "stage1.onnx").unlink()
    with pytest.raises(EngineLoadError, match="engine file stage1.onnx is missing"):
        load_engine(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files"]["stage1.onnx"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineLoadError, match="lists no checksum for the engine graph stage1.onnx"):
        load_engine(copy)


def test_stages_in_ray_actors_generate_what_the_one_graph_does(engines):
    """--pipeline-parallel 2: each stage in a Ray actor, hidden states handed on by chained actor calls, a step's
    two micro-batches (the default: one per stage) in flight at once."""
    pytest.importorskip("ray")
    config = RuntimeConfig(num_threads=1, kv_cache_bytes=12 * 16384, max_model_len=96)
    want, _ = staggered_greedy(engines[1], STAGGERED, config)
    import ray

    try:
        got, stats = staggered_greedy(engines[2], STAGGERED, dataclasses.replace(config, pipeline_parallel=2))
    finally:
        ray.shutdown()  # the local Ray this started sized its CPUs for two stages; later Ray tests size their own
    assert got == want and stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


def test_micro_batches_need_a_staged_engine(engines):
    from kiln.runtime.loader import load_engine

    with pytest.raises(EngineLoadError, match="pipeline_micro_batches is for an engine of pipeline stages "
                                              r"\(kiln build --pipeline-stages N\), and .*one is one graph"):
        load_engine(engines[1], RuntimeConfig(num_threads=1, pipeline_micro_batches=2))


def test_pipeline_parallel_needs_an_engine_of_as_many_stages(engines):
    from kiln.runtime.loader import load_engine

    with pytest.raises(EngineLoadError, match="--pipeline-parallel 3 needs an engine of 3 stages, and .* has 2 "
                                              "pipeline stages; build it with kiln build --pipeline-stages 3"):
        load_engine(engines[2], RuntimeConfig(num_threads=1, pipeline_parallel=3))


def test_kv_blocks_read_and_write_across_the_stages(engines):
    """KV export (disaggregation's hand-off) reads every stage's layers in order: what the one graph's pools hold."""
    from kiln.runtime.loader import open_engine_runner

    runners = [open_engine_runner(engines[n], read_manifest(engines[n]), 4, 1) for n in (1, 3)]
    for runner in runners:
        runner.execute(pack_chunks([Chunk(0, PROMPTS[2], [2, 3])], False))
    one, staged = runners
    assert staged.kv_layout() == one.kv_layout()
    np.testing.assert_array_equal(staged.read_kv_blocks([2, 3]), one.read_kv_blocks([2, 3]))
    staged.write_kv_blocks([0], one.read_kv_blocks([3]))
    np.testing.assert_array_equal(staged.read_kv_blocks([0]), one.read_kv_blocks([3]))
