"""manifest.json against its schema, and the engine files it must checksum: every problem one sentence
naming the field or file (no engine is built: a manifest over small stand-in files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.manifest import MANIFEST_NAME, BuildOptions, EngineLoadError, Manifest, read_manifest, write_manifest
from kiln.spec import ModelSpec, RopeScaling

SPEC = ModelSpec(family="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                 tie_word_embeddings=True, rope_scaling=RopeScaling("llama3", 8.0), eos_token_ids=(2,))


@pytest.fixture
def engine_dir(tmp_path) -> Path:
    for name, data in [("model.onnx", b"graph"), ("model.onnx.data", b"\0" * 64), ("tokenizer.json", b"{}"),
                       ("tokenizer_config.json", b"{}")]:
        (tmp_path / name).write_bytes(data)
    write_manifest(tmp_path, Manifest(spec=SPEC, build=BuildOptions(max_seq_len=512), backend="onnxruntime-cpu",
                                      graph_inputs=("input_ids",), graph_outputs=("logits",)))
    return tmp_path


def _edit(engine_dir: Path, edit) -> None:
    """edit: a function changing the manifest's JSON in place, or a JSON value to replace it with."""
    path = engine_dir / MANIFEST_NAME
    data = json.loads(path.read_text())
    if callable(edit):
        edit(data)
    else:
        data = edit
    path.write_text(json.dumps(data))


def test_a_written_manifest_reads_back(engine_dir):
    manifest = read_manifest(engine_dir)
    assert manifest.spec == SPEC and manifest.max_seq_len == 512
    assert set(manifest.files) == {"model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"}


@pytest.mark.parametrize("edit, message", [
    ([], "manifest.json must be a JSON object, got a list"),
    ("engine", "manifest.json must be a JSON object, got a string"),
    (lambda d: d["build"].update(block_size="16"), "manifest.json field build.block_size must be an integer, got '16'"),
    (lambda d: d["build"].update(max_seq_len=True), "field build.max_seq_len must be an integer, got True"),
    (lambda d: d["build"].pop("kv_dtype"), "manifest.json lacks the field build.kv_dtype"),
    (lambda d: d.pop("graph"), "manifest.json lacks the field graph"),
    (lambda d: d["graph"].update(inputs="input_ids"), "field graph.inputs must be a list of strings, got 'input_ids'"),
    (lambda d: d["graph"]["outputs"].append(3), r"field graph.outputs\[1\] must be a string, got 3"),
    (lambda d: d["model_spec"].pop("vocab_size"), "manifest.json lacks the field model_spec.vocab_size"),
    (lambda d: d["model_spec"].update(rms_norm_eps="1e-5"), "field model_spec.rms_norm_eps must be a number"),
    (lambda d: d["model_spec"].update(tie_word_embeddings=1), "tie_word_embeddings must be true or false, got 1"),
    (lambda d: d["model_spec"].update(eos_token_ids=[2, None]), r"model_spec.eos_token_ids\[1\] must be an integer"),
    (lambda d: d["model_spec"]["rope_scaling"].pop("factor"), "lacks the field model_spec.rope_scaling.factor"),
    (lambda d: d["model_spec"].update(num_kv_heads=3), "model_spec is inconsistent: num_heads .4. is not a multiple"),
    (lambda d: d["model_spec"].update(n_experts=8), "manifest.json has an unknown field model_spec.n_experts"),
    (lambda d: d["build"].update(calibration=0), "field build.calibration must be a string or null, got 0"),
    (lambda d: d["build"].update(kv_dtype="int3"), "field build.kv_dtype is invalid: kv_dtype must be one of"),
    (lambda d: d["build"].update(quantization="int4-rtn-g7"), "field build.quantization is invalid: unknown quant"),
    (lambda d: d["files"].update({"model.onnx": 5}), r"field files\['model.onnx'\] must be a string, got 5"),
    (lambda d: d["files"].update({"../secret": "00"}), "lists '../secret', which is not a path inside the engine"),
    (lambda d: d.update(op_library_abi="1"), "field op_library_abi must be an integer"),
])
def test_a_manifest_off_its_schema_is_one_sentence_naming_the_field(engine_dir, edit, message):
    _edit(engine_dir, edit)
    with pytest.raises(EngineLoadError, match=message) as err:
        read_manifest(engine_dir)
    assert "\n" not in str(err.value)


def test_not_json_is_one_sentence(engine_dir):
    (engine_dir / MANIFEST_NAME).write_text('{"format_version": 1,')
    with pytest.raises(EngineLoadError, match="manifest.json is not valid JSON"):
        read_manifest(engine_dir)


@pytest.mark.parametrize("name", ["model.onnx.data", "tokenizer.json"])
def test_a_file_the_manifest_does_not_checksum_is_refused(engine_dir, name):
    """Dropped from "files", a weights or tokenizer file would load unverified: a flipped byte must not pass."""
    _edit(engine_dir, lambda d: d["files"].pop(name))
    data = bytearray((engine_dir / name).read_bytes())
    data[0] ^= 1
    (engine_dir / name).write_bytes(bytes(data))
    with pytest.raises(EngineLoadError, match=f"engine file {name} is not checksummed by manifest.json"):
        read_manifest(engine_dir)


def test_an_extra_file_anywhere_in_the_engine_dir_is_refused(engine_dir):
    (engine_dir / "weights").mkdir()
    (engine_dir / "weights" / "shard-1.bin").write_bytes(b"x")
    with pytest.raises(EngineLoadError, match="engine file weights/shard-1.bin is not checksummed"):
        read_manifest(engine_dir)


def test_a_manifest_holds_a_resolved_context():
    with pytest.raises(ValueError, match="build.max_seq_len must be set in a manifest"):
        Manifest(spec=SPEC, build=BuildOptions(), backend="onnxruntime-cpu", graph_inputs=(), graph_outputs=())


def test_a_corrupt_tokenizer_is_one_sentence(tmp_path):
    from kiln.runtime.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {')
    with pytest.raises(EngineLoadError, match=r"^engine file tokenizer.json is not a valid tokenizer \(.+\)$"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("config, message", [
    ("{", "engine file tokenizer_config.json is not valid JSON"),
    ("[]", "engine file tokenizer_config.json must hold a JSON object"),
    ('{"eos_token": 2}', "tokenizer_config.json: eos_token must be a token string, got 2"),
    ('{"chat_template": [{"name": "default"}]}', "tokenizer_config.json: chat_template must be a string or a list"),
])
def test_a_corrupt_tokenizer_config_is_one_sentence(tmp_path, config, message):
    from helpers import write_tiny_tokenizer

    from kiln.runtime.tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    assert Tokenizer(tmp_path).chat_template  # the tiny tokenizer as written loads
    (tmp_path / "tokenizer_config.json").write_text(config)
    with pytest.raises(EngineLoadError, match=message):
        Tokenizer(tmp_path)


def test_optional_build_fields_are_written_only_when_they_mean_something():
    """An engine that uses no pipeline, rank or quantized encoder stays readable by a kiln that predates them."""
    from kiln.vision import EncoderQuantization

    plain = BuildOptions().to_dict()
    assert not {"pipeline_stages", "tensor_parallel", "vision_quantization"} & plain.keys()
    assert BuildOptions.from_dict(plain) == BuildOptions()
    split = BuildOptions(pipeline_stages=2, vision_quantization=EncoderQuantization.INT8)
    assert split.to_dict()["pipeline_stages"] == 2 and split.to_dict()["vision_quantization"] == "int8"
    assert BuildOptions.from_dict(split.to_dict()) == split


def test_engine_abi_asks_for_the_newest_library_only_of_engines_that_need_it():
    """An engine records ABI 15 only with a centre on Q4_1 weights (Q4_0 files), 14 with Q8_0 records, 13 with
    kiln.PagedAttention's q/k norms, 12 with kiln.MatMulGGUF records, 11 with kiln.MoE records and neither; every other
    engine the build writes records 10, which kilns of ABI 10 load. A new ABI must say here which engines need it."""
    from kiln.contract import (
        CENTRE_ABI,
        ENGINE_NEEDS,
        GGUF_RECORDS_ABI,
        MOE_RECORDS_ABI,
        MORE_RECORDS_ABI,
        OP_LIBRARY_ABI,
        QK_NORM_ABI,
        engine_abi,
    )

    assert engine_abi({"q4_1_centres"}) == engine_abi(ENGINE_NEEDS) == CENTRE_ABI == OP_LIBRARY_ABI
    assert engine_abi({"newer_records"}) == engine_abi({"moe_records", "gguf_records", "qk_norms", "newer_records"})
    assert engine_abi({"newer_records"}) == MORE_RECORDS_ABI == OP_LIBRARY_ABI - 1
    assert engine_abi({"qk_norms"}) == engine_abi({"moe_records", "gguf_records", "qk_norms"}) == QK_NORM_ABI
    assert QK_NORM_ABI == OP_LIBRARY_ABI - 2
    assert engine_abi({"gguf_records"}) == engine_abi({"moe_records", "gguf_records"}) == GGUF_RECORDS_ABI
    assert GGUF_RECORDS_ABI == OP_LIBRARY_ABI - 3
    assert engine_abi({"moe_records"}) == MOE_RECORDS_ABI == OP_LIBRARY_ABI - 4
    assert engine_abi(set()) == MOE_RECORDS_ABI - 1
    with pytest.raises(KeyError, match="rope_scaling"):  # a need with no ABI is a build's mistake, not ABI 10
        engine_abi({"rope_scaling"})
