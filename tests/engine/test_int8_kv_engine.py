"""An int8 KV cache end to end on a tiny random llama: `kiln build --kv-dtype int8 --calibration`
wires one kv_scale.{i} initializer (the artifact's per-head steps) into each layer's
kiln.PagedAttention, the manifest says int8, the runtime allocates int8 pools, and the engine
generates through kiln.runtime.LLM with logits close to the fp32 engine's."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from kiln.contract import OP_LIBRARY_ABI  # noqa: E402
from kiln.manifest import BuildOptions, read_manifest  # noqa: E402
from kiln.optimize.build import BuildError, build_engine  # noqa: E402
from kiln.quant_scheme import QuantScheme  # noqa: E402
from kiln.runtime import LLM, RuntimeConfig, SamplingParams  # noqa: E402
from kiln.runtime.model_runner import Chunk, pack_chunks  # noqa: E402

QUIET = dict(progress=lambda _msg: None)


@pytest.fixture(scope="module")
def artifact_dir(tiny_model_dir, tmp_path_factory):
    import torch

    from kiln.calibration.calibrate import CalibrationConfig, calibrate
    from kiln.export.checkpoint import load_checkpoint

    ck = load_checkpoint(tiny_model_dir)
    ids = torch.randint(3, 300, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    config = CalibrationConfig("smoothquant", num_windows=8, window=128, rows_per_window=8, alpha=0.5)
    artifact = calibrate(ck, ids, config)
    return artifact.save(tmp_path_factory.mktemp("calib") / "artifact")


@pytest.fixture(scope="module")
def int8_engine(tiny_model_dir, artifact_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8-engine") / "engine"
    build_engine(tiny_model_dir, out, BuildOptions(kv_dtype="int8", calibration=artifact_dir), **QUIET)
    return out


def test_graph_carries_per_layer_kv_scales(int8_engine, artifact_dir):
    import onnx
    from onnx import numpy_helper

    from kiln.calibration.artifact import CalibrationArtifact

    manifest = read_manifest(int8_engine)
    assert manifest.build.kv_dtype == "int8" and manifest.build.calibration == artifact_dir
    model = onnx.load(str(int8_engine / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    k, v = CalibrationArtifact.load(artifact_dir).kv_scales()
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention" and n.domain == "kiln"]
    assert len(nodes) == manifest.spec.num_layers
    for node in nodes:
        layer = int(node.input[3].rsplit(".", 1)[1])
        assert node.input[3] == f"kv_cache.{layer}" and node.input[7] == f"kv_scale.{layer}"
        expected = np.stack([k[layer].numpy(), v[layer].numpy()]).astype(np.float32)
        np.testing.assert_array_equal(inits[f"kv_scale.{layer}"], expected)
    pool = next(i for i in model.graph.input if i.name == "kv_cache.0")
    assert pool.type.tensor_type.elem_type == onnx.TensorProto.INT8


def _prefill_then_decode(llm, prompt, next_token):
    """All-row logits of a prefill of `prompt` into blocks 0.., then of one decode step."""
    runner = llm.engine.runner
    table = list(range(-(-(len(prompt) + 1) // runner.block_size)))
    prefill = pack_chunks([Chunk(0, prompt, table)], all_rows=True)
    decode = pack_chunks([Chunk(len(prompt), [next_token], table)], all_rows=True)
    return np.concatenate([runner.execute(prefill), runner.execute(decode)])


def test_int8_engine_generates_close_to_fp32(int8_engine, tiny_engine):
    from tokenizers import Tokenizer

    config = RuntimeConfig(kv_cache_bytes=1 << 20)
    fp32, int8 = LLM(tiny_engine, config), LLM(int8_engine, config)
    assert all(p.dtype == np.int8 for p in int8.engine.runner.pools)
    assert int8.engine.runner.pool_spec.bytes_per_block * 4 == fp32.engine.runner.pool_spec.bytes_per_block
    assert int8.engine.runner.num_blocks == 4 * fp32.engine.runner.num_blocks  # same bytes, 4x the tokens

    prompt = [(37 * j) % 290 + 3 for j in range(45)]
    ref, got = _prefill_then_decode(fp32, prompt, 7), _prefill_then_decode(int8, prompt, 7)
    err = np.abs(got - ref)
    assert err.max() < 0.03 * np.abs(ref).max(), (err.max(), np.abs(ref).max())  # ~0.9% seen
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[(17 * i + 5 * j) % 290 + 3 for j in range(8 + 9 * i)] for i in range(4)]
    outs = int8.generate(prompts, greedy)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    text = int8.generate("hello world", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert text.text == Tokenizer.from_file(str(int8_engine / "tokenizer.json")).decode(text.token_ids)


def test_int8_kv_needs_a_calibration_artifact(tiny_model_dir, tmp_path):
    with pytest.raises(BuildError, match="an int8 KV cache needs the per-head K/V scales of a calibration artifact"):
        build_engine(tiny_model_dir, tmp_path / "e", BuildOptions(kv_dtype="int8"), **QUIET)
    assert not (tmp_path / "e").exists()


def test_int8_kv_refuses_another_models_artifact(tmp_path, artifact_dir):
    from helpers import make_tiny_hf_model

    other = make_tiny_hf_model(tmp_path / "other", "llama", seed=5)
    with pytest.raises(BuildError, match="made for another model"):
        build_engine(other, tmp_path / "e", BuildOptions(kv_dtype="int8", calibration=artifact_dir), **QUIET)


def test_cli_int8_without_calibration_is_one_sentence(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(main, ["build", str(tiny_model_dir), "-o", str(tmp_path / "e"), "--kv-dtype", "int8"])
    assert result.exit_code != 0 and "needs the per-head K/V scales" in result.output


@pytest.mark.parametrize("abi, loads", [(abi, True) for abi in range(1, OP_LIBRARY_ABI + 1)]
                         + [(0, False), (OP_LIBRARY_ABI + 1, False)])
def test_engines_of_older_compatible_abis_still_load(tiny_engine, tmp_path, abi, loads):
    """ABIs after 1 only added optional inputs (kv_scale; cos/sin caches; attend_until), attributes
    (rotary_interleaved, softcap), int8 pools and new ops: older engines still run; an ABI newer than the library
    does not."""
    import json
    import shutil

    from kiln.manifest import EngineLoadError

    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["op_library_abi"] = abi
    (engine / "manifest.json").write_text(json.dumps(manifest))
    if loads:
        assert read_manifest(engine).op_library_abi == abi
    else:
        with pytest.raises(EngineLoadError, match=f"engine was built for kiln op-library ABI {abi}"):
            read_manifest(engine)


def test_int8_kv_with_a_weight_scheme_that_needs_no_calibration(tiny_model_dir, artifact_dir, tmp_path):
    """The artifact then serves the KV steps alone: int8-weight-only folds no smoothing scales."""
    messages = []
    options = BuildOptions(kv_dtype="int8", quantization=QuantScheme.parse("int8-weight-only"),
                           calibration=artifact_dir)
    manifest = build_engine(tiny_model_dir, tmp_path / "e", options, progress=messages.append)
    assert manifest.build.kv_dtype == "int8" and manifest.build.quantization.name == "int8-weight-only"
    assert not any("folded" in m for m in messages) and any("int8 KV cache" in m for m in messages)
    out = LLM(tmp_path / "e", RuntimeConfig(kv_cache_bytes=1 << 20)).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_eval_driver_sizes_int8_pools(int8_engine, tiny_engine):
    """`kiln eval`'s engine session on an int8-KV engine: perplexity within 1% of the fp32 engine's."""
    from kiln.evaluation.evaluate import EngineSession, perplexity

    ids = [(37 * j + j // 7) % 290 + 3 for j in range(200)]
    sessions = [EngineSession(e, max_tokens=256, threads=1) for e in (tiny_engine, int8_engine)]
    assert sessions[1].runner.pools[0].dtype == np.int8
    # max_tokens in blocks, whatever the dtype
    assert sessions[1].runner.num_blocks == sessions[0].runner.num_blocks == 256 // 16
    ppl32, ppl8 = (perplexity(s, ids, window=100, num_windows=2)[0] for s in sessions)
    assert ppl8 == pytest.approx(ppl32, rel=0.01)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_int8_engine_logits_agree_through_every_driver(int8_engine):
    """The runtime (scheduler, block manager, build_batch; all prompts in one step) against the tests'
    PagedDriver (bump-allocated blocks, prompts split in two packed steps) and `kiln eval`'s
    EngineSession (one sequence, chunks of 16) on the same int8 engine: every generated token's top-20
    logprobs agree, and each driver's argmax is the runtime's greedy token."""
    from engine_driver import PagedDriver

    from kiln.evaluation.evaluate import EngineSession

    prompts = [[(29 * i + 11 * j) % 290 + 3 for j in range(20 + 13 * i)] for i in range(3)]
    llm = LLM(int8_engine, RuntimeConfig(kv_cache_bytes=1 << 20, num_threads=1))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=20))
    generated = [o.outputs[0].token_ids for o in outs]
    runtime_top = [o.outputs[0].logprobs for o in outs]

    driver = PagedDriver(int8_engine / "model.onnx", num_blocks=16, threads=1)
    assert driver.runner.pools[0].dtype == np.int8
    driver.step([(i, p[:10]) for i, p in enumerate(prompts)])
    rest = [p[10:] + g[:-1] for p, g in zip(prompts, generated, strict=True)]
    rows = driver.step(list(enumerate(rest)), all_rows=True)
    ends = np.cumsum([len(r) for r in rest])
    driven = [rows[end - len(g):end] for end, g in zip(ends, generated, strict=True)]

    session = EngineSession(int8_engine, max_tokens=128, threads=1)
    assert session.runner.pools[0].dtype == np.int8
    evaluated = [session.prefill(p + g[:-1], chunk=16)[len(p) - 1:] for p, g in zip(prompts, generated, strict=True)]

    for name, logits in (("PagedDriver", driven), ("EngineSession", evaluated)):
        for s, (tokens, steps, rows) in enumerate(zip(generated, runtime_top, logits, strict=True)):
            assert rows.argmax(-1).tolist() == tokens, f"{name}, sequence {s}: greedy tokens differ"
            logp = _log_softmax(rows)
            err = max(abs(logp[j, t] - lp.logprob) for j, top in enumerate(steps) for t, lp in top.items())
            assert err < 1e-4, f"{name}, sequence {s}: top logprobs differ from the runtime's by {err:.2e}"


def test_runner_refuses_pools_the_graph_does_not_declare(int8_engine):
    """A description of the pools that disagrees with the graph's kv_cache inputs (a manifest edited
    by hand, a graph swapped in) fails at load in one sentence, not as an ORT type error mid-step."""
    from dataclasses import replace

    from kiln.contract import KvPoolSpec
    from kiln.manifest import EngineLoadError
    from kiln.runtime.ort_runner import OrtModelRunner, graph_kv_pools, open_session

    session = open_session(int8_engine / "model.onnx", num_threads=1)
    declared = graph_kv_pools(session)
    spec = read_manifest(int8_engine).spec
    assert declared == KvPoolSpec(spec.num_layers, spec.num_kv_heads, 16, spec.head_dim, "int8")
    for wrong in (replace(declared, kv_dtype="float32"), replace(declared, block_size=8)):
        with pytest.raises(EngineLoadError, match="rebuild the engine"):
            OrtModelRunner(session, wrong, num_blocks=4)
    with pytest.raises(ValueError, match="KV dtype 'int3' is not one of"):
        replace(declared, kv_dtype="int3")


def test_a_steps_logits_outlive_later_steps(tiny_engine):
    """The runner hands back ORT's own logits buffer (no copy, no Python OrtValue per output): it stays valid and
    unchanged while later steps run and allocate theirs."""
    import gc

    from kiln.runtime.ort_runner import OrtModelRunner, graph_kv_pools, open_session

    session = open_session(tiny_engine / "model.onnx", num_threads=1)
    runner = OrtModelRunner(session, graph_kv_pools(session), num_blocks=8)
    first = runner.execute(pack_chunks([Chunk(0, [1, 2, 3], [0])], all_rows=True))
    kept = first.copy()
    later = [runner.execute(pack_chunks([Chunk(0, [4 + i, 5, 6, 7], [1])], all_rows=True)) for i in range(4)]
    gc.collect()
    assert first.shape == (3, runner.vocab_size)
    np.testing.assert_array_equal(first, kept)
    assert all(not np.shares_memory(first, other) for other in later)
    assert not np.array_equal(later[0], later[1])  # each step's own logits
