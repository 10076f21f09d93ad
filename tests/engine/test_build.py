"""kiln build: engine directory layout, manifest, CLI, and option errors (tiny model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln import contract
from kiln.errors import InvalidParamError
from kiln.manifest import BACKEND_ORT_CPU, BuildOptions, EngineLoadError, read_manifest
from kiln.optimize.build import BuildError, build_engine
from kiln.optimize.fuse_attention import AttentionConfig
from kiln.quant_scheme import QuantScheme


def test_engine_dir_and_manifest(tiny_engine):
    manifest = read_manifest(tiny_engine)  # verifies every checksum
    assert set(manifest.files) == {"model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"}
    assert manifest.backend == BACKEND_ORT_CPU
    assert manifest.spec.num_layers == 2
    assert manifest.max_seq_len == manifest.spec.max_position_embeddings == 2048
    layers = range(manifest.spec.num_layers)
    assert manifest.graph_inputs == (
        contract.INPUT_IDS, contract.POSITION_IDS, contract.QUERY_START_LOC, contract.SEQ_LENS,
        contract.BLOCK_TABLES, contract.LOGITS_INDICES, *(contract.kv_cache_input(i) for i in layers))
    assert manifest.graph_outputs == (contract.LOGITS, *(contract.kv_cache_output(i) for i in layers))
    assert "chat_template" in json.loads((tiny_engine / "tokenizer_config.json").read_text())


def test_cli_build_defaults_to_a_float16_kv_cache(tmp_path, tiny_model_dir, tiny_engine):
    """`kiln build` without --kv-dtype makes an fp16 pool: same logits as the fp32-KV engine within fp16 rounding."""
    from click.testing import CliRunner
    from engine_driver import PagedDriver

    from kiln.cli import main

    out = tmp_path / "engine16"
    result = CliRunner().invoke(main, ["build", str(tiny_model_dir), "-o", str(out), "--block-size", "8",
                                       "--max-seq-len", "256"])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert (manifest.build.kv_dtype, manifest.build.block_size, manifest.build.max_seq_len) == ("float16", 8, 256)
    tokens = np.random.default_rng(0).integers(0, manifest.spec.vocab_size, 30).tolist()
    logits = []
    for engine in (tiny_engine, out):
        driver = PagedDriver(engine / "model.onnx", num_blocks=8)
        logits.append(np.concatenate([driver.step([(0, tokens[:25])], all_rows=True)]
                                     + [driver.step([(0, [t])]) for t in tokens[25:]]))
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-2, rtol=0)


@pytest.mark.parametrize("options, message", [
    (BuildOptions(quantization=QuantScheme.parse("w8a8-smoothquant")), "needs the scales of `kiln calibrate"),
    (BuildOptions(kv_dtype="int8"), "an int8 KV cache needs the per-head K/V scales"),
    (BuildOptions(calibration=Path("calib")), "quantization none uses no calibration artifact"),
])
def test_options_that_do_not_pair_fail_before_any_work(tmp_path, options, message):
    """BuildOptions checks each field; the build checks which artifact the choices need, before loading."""
    with pytest.raises(BuildError, match=message):
        build_engine(tmp_path / "no-such-model", tmp_path / "out", options)


def test_unusable_model_source_is_a_build_error(tmp_path):
    with pytest.raises(BuildError, match="no such file or directory"):
        build_engine(tmp_path / "no-such-model", tmp_path / "out", progress=lambda _msg: None)


def test_manifests_of_older_builds_still_load(tiny_engine, tmp_path):
    """Engines built before the typed options carry dtype and calibration "" in their build object."""
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["build"]["calibration"] is None and "dtype" not in manifest["build"]
    manifest["build"].update(dtype="float32", calibration="", quantization="int8-weight-only")
    (engine / "manifest.json").write_text(json.dumps(manifest))
    build = read_manifest(engine).build
    assert build.calibration is None and build.quantization == QuantScheme.parse("int8-weight-only")
    manifest["build"]["quantization"] = "int4-rtn-g7"
    (engine / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineLoadError, match="build.quantization is invalid: unknown quantization 'int4-rtn-g7'"):
        read_manifest(engine)


def test_attention_config_kv_scales():
    scales = np.ones((2, 2, 3), np.float32)
    assert AttentionConfig("int8", kv_scales=scales).kv_scales is scales
    for kv_dtype, bad in [("int8", None), ("int8", scales.astype(np.float64)), ("int8", scales[0]),
                          ("int8", [[[1.0, 1.0]]]), ("float32", scales)]:
        with pytest.raises(InvalidParamError, match="^kv_scales must be") as err:
            AttentionConfig(kv_dtype, kv_scales=bad)
        assert err.value.param == "kv_scales"


def test_refuses_to_overwrite_a_non_engine_dir(tmp_path, tiny_model_dir):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(BuildError, match="not a kiln engine directory"):
        build_engine(tiny_model_dir, out, progress=lambda _msg: None)
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("previous_engine", [False, True])
def test_an_interrupted_build_leaves_no_half_engine(tmp_path, monkeypatch, tiny_model_dir, tiny_engine,
                                                    previous_engine):
    """Interrupted once the graph and manifest are written: the output is as before (absent, or the previous
    engine intact) and no hidden staging directory is left beside it."""
    out = tmp_path / "engine"
    if previous_engine:
        shutil.copytree(tiny_engine, out)

    def interrupted(_engine_dir, _graph_files):
        assert (Path(_engine_dir) / "model.onnx").is_file() and (Path(_engine_dir) / "manifest.json").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr("kiln.optimize.build.verify_engine", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_engine(tiny_model_dir, out, progress=lambda _msg: None)
    assert [p.name for p in tmp_path.iterdir()] == (["engine"] if previous_engine else [])
    if previous_engine:
        assert read_manifest(out).files == read_manifest(tiny_engine).files


def test_a_failed_write_says_where_the_space_ran_out(tmp_path, monkeypatch, tiny_model_dir):
    """numpy's words for a full disk become a BuildError with the free space of the temp and engine dirs."""
    def full_disk(_model, _engine_dir):
        raise OSError("problem writing element 367616 to file")

    monkeypatch.setattr("kiln.optimize.build._save_graph", full_disk)
    with pytest.raises(BuildError, match=r"writing the engine failed \(problem writing element 367616 to file\); "
                                         r"[0-9.]+ GiB free in "):
        build_engine(tiny_model_dir, tmp_path / "engine", progress=lambda _msg: None)
    assert list(tmp_path.iterdir()) == []


def test_a_build_shows_progress_for_export_quantization_and_writing(tmp_path, tiny_model_dir, recorded_bars):
    """Each long stage has a bar that runs to its end: the export over the traced layers and the exporter's
    phases, the quantization pass over the linears, the writer over the tensors."""
    manifest = build_engine(tiny_model_dir, tmp_path / "engine", BuildOptions(quantization=QuantScheme.parse(
        "int8-weight-only")), progress=lambda _msg: None)
    bars = {description: (done, total) for description, done, total in recorded_bars}
    assert list(bars) == ["export onnx", "quantize int8", "write engine"]
    layers = manifest.spec.num_layers
    assert bars["export onnx"] == (layers + 4, layers + 4)  # layers, 3 exporter phases, the save
    assert bars["quantize int8"] == (4 * layers + 1, 4 * layers + 1)  # qkv, o, gate-up, down per layer; the LM head
    assert bars["write engine"][0] == bars["write engine"][1] > 0
