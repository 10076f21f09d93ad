"""Build options as `kiln build` sees them: scheme names parsed once into typed values, each bad
field named in one sentence, artifact requirements, and the manifest's "build" object."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.errors import InvalidParamError, KilnError
from kiln.manifest import BuildOptions
from kiln.optimize.quantize import QuantizationError, check_lm_head, check_options
from kiln.quant_scheme import SCHEMES, LmHead, QuantMethod, QuantScheme
from kiln.vision import EncoderQuantization

README_NAMES = {"none", "int8-weight-only", "int4-rtn-g32", "int4-rtn-g64", "int4-rtn-g128", "int4-awq-g32",
                "int4-awq-g64", "int4-awq-g128", "int4-q4_1", "w8a8-smoothquant", "gguf",
                "gguf-exact"}


def assert_one_sentence(err: pytest.ExceptionInfo, param: str, *words: str) -> None:
    message = str(err.value)
    assert isinstance(err.value, KilnError) and err.value.param == param
    assert "\n" not in message and param in message
    for word in words:
        assert word in message, message


def test_scheme_names_round_trip():
    assert set(SCHEMES) == README_NAMES
    for name in README_NAMES:
        scheme = QuantScheme.parse(name)
        assert scheme.name == str(scheme) == name
        assert QuantScheme(scheme.method, scheme.group_size) == scheme  # a plain value: rebuilt from its fields


def test_parsed_fields():
    assert QuantScheme.parse("int4-awq-g64") == QuantScheme(QuantMethod.INT4_AWQ, 64)
    assert QuantScheme.parse("int4-rtn-g32") == QuantScheme(QuantMethod.INT4_RTN, 32)
    assert QuantScheme.parse("int4-q4_1") == QuantScheme(QuantMethod.INT4_Q4_1)
    assert QuantScheme.parse("none") == QuantScheme() == BuildOptions().quantization
    assert [QuantScheme.parse(n).calibration for n in ("int4-awq-g128", "w8a8-smoothquant", "int4-rtn-g128",
                                                       "int8-weight-only", "none")] == ["awq", "smoothquant", None,
                                                                                         None, None]


@pytest.mark.parametrize("name", ["int3", "int4-rtn-g16", "int4-rtn", "int4-awq-g", "INT8-WEIGHT-ONLY", "",
                                  "int4-q4_1-g32", "w8a8"])
def test_unknown_scheme_is_one_sentence_naming_quantization(name):
    with pytest.raises(InvalidParamError) as err:
        QuantScheme.parse(name)
    assert_one_sentence(err, "quantization", f"unknown quantization {name!r}", "int4-awq-g128")


@pytest.mark.parametrize("method, group_size, param", [
    (QuantMethod.INT4_RTN, None, "group_size"),
    (QuantMethod.INT4_AWQ, 16, "group_size"),
    (QuantMethod.NONE, 32, "group_size"),
    (QuantMethod.INT4_Q4_1, 32, "group_size"),
    ("int4-rtn", 32, "method"),
])
def test_bad_scheme_field_is_one_sentence_naming_it(method, group_size, param):
    with pytest.raises(InvalidParamError) as err:
        QuantScheme(method, group_size)
    assert_one_sentence(err, param, repr(group_size if param == "group_size" else method))


@pytest.mark.parametrize("field, value", [
    ("kv_dtype", "int3"),
    ("block_size", 0),
    ("max_seq_len", -1),
    ("max_num_tokens", 0),
    ("block_size", 16.0),
    ("quantization", "int4-rtn-g128"),  # a name is parsed first: QuantScheme.parse
    ("calibration", "calib/sq"),  # a Path or None, not a string that "" could stand in for
    ("lm_head", "int4"),  # a name is parsed first: LmHead.parse
])
def test_bad_build_option_is_one_sentence_naming_it(field, value):
    with pytest.raises(InvalidParamError) as err:
        BuildOptions(**{field: value})
    assert_one_sentence(err, field, repr(value))
    assert str(err.value).startswith(f"{field} must be")


def test_build_options_dict_round_trip():
    options = BuildOptions(quantization=QuantScheme.parse("int4-awq-g64"), kv_dtype="int8", block_size=8,
                           max_seq_len=256, max_num_tokens=64, calibration=Path("calib/awq"), lm_head=LmHead.INT4,
                           medusa=Path("heads/smollm2"), pipeline_stages=2,
                           vision_quantization=EncoderQuantization.INT8)
    data = options.to_dict()
    assert data == {"quantization": "int4-awq-g64", "kv_dtype": "int8", "block_size": 8, "max_seq_len": 256,
                    "max_num_tokens": 64, "calibration": "calib/awq", "lm_head": "int4", "medusa": "heads/smollm2",
                    "pipeline_stages": 2, "vision_quantization": "int8"}  # one rank: tensor_parallel unwritten
    assert BuildOptions.from_dict(data) == options
    assert BuildOptions().to_dict()["calibration"] is None and BuildOptions().to_dict()["medusa"] is None
    assert BuildOptions().kv_dtype == "float16"  # the default: fp32's perplexity, half the KV bytes
    assert BuildOptions.from_dict(BuildOptions().to_dict()) == BuildOptions()


def test_older_manifests_build_object_still_reads():
    """Manifests written before the typed options carry dtype (always float32) and "" for no artifact;
    those written before --lm-head have no lm_head (int8, what they were built with)."""
    old = {"dtype": "float32", "quantization": "int8-weight-only", "kv_dtype": "float16", "block_size": 16,
           "max_seq_len": 2048, "max_num_tokens": 2048, "calibration": ""}
    assert BuildOptions.from_dict(old) == BuildOptions(quantization=QuantScheme.parse("int8-weight-only"),
                                                       kv_dtype="float16", max_seq_len=2048)
    assert BuildOptions.from_dict(old).lm_head is LmHead.INT8
    assert BuildOptions.from_dict(old).vision_quantization is EncoderQuantization.FLOAT32  # every encoder was
    with pytest.raises(InvalidParamError, match="unknown vision encoder quantization 'int4'"):
        BuildOptions.from_dict({**old, "vision_quantization": "int4"})
    with pytest.raises(InvalidParamError, match="unknown quantization 'int9'"):
        BuildOptions.from_dict({**old, "quantization": "int9"})
    with pytest.raises(InvalidParamError, match="unknown LM head precision 'int2'"):
        BuildOptions.from_dict({**old, "lm_head": "int2"})


def test_int4_lm_head_only_with_int4_schemes():
    for name in ("int4-rtn-g32", "int4-awq-g128", "int4-q4_1"):
        check_lm_head(QuantScheme.parse(name), LmHead.INT4)
    for name in SCHEMES:
        check_lm_head(QuantScheme.parse(name), LmHead.INT8)
    for name in ("none", "int8-weight-only", "w8a8-smoothquant", "gguf", "gguf-exact"):
        with pytest.raises(QuantizationError, match=f"not quantization {name}; drop --lm-head int4"):
            check_lm_head(QuantScheme.parse(name), LmHead.INT4)


def test_artifact_requirements():
    sq_dir = Path("/some/dir")
    check_options(QuantScheme.parse("int4-rtn-g128"), None)
    check_options(QuantScheme.parse("w8a8-smoothquant"), sq_dir)
    with pytest.raises(QuantizationError, match="needs the scales of `kiln calibrate MODEL --method smoothquant"):
        check_options(QuantScheme.parse("w8a8-smoothquant"), None)
    with pytest.raises(QuantizationError, match="needs the scales of `kiln calibrate MODEL --method awq"):
        check_options(QuantScheme.parse("int4-awq-g32"), None)
    with pytest.raises(QuantizationError, match="uses no calibration artifact"):
        check_options(QuantScheme.parse("int8-weight-only"), sq_dir)


def test_cli_build_refuses_a_missing_artifact_before_any_work(tmp_path):
    result = CliRunner().invoke(main, ["build", str(tmp_path / "no-model"), "-o", str(tmp_path / "e"),
                                       "--quantization", "int4-awq-g128"])
    assert result.exit_code != 0
    assert "--method awq" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("args, message", [
    (["--quantization", "int3"], "Error: unknown quantization 'int3'; choose one of ["),
    (["--block-size", "0"], "Error: block_size must be a positive integer, got 0"),
    (["--lm-head", "int4"], "Error: an int4 LM head goes with the int4 schemes"),
    (["--lm-head", "int4-rescored"], "Error: an int4-rescored LM head goes with the int4 schemes"),
])
def test_cli_build_bad_option_is_one_line(tmp_path, args, message):
    result = CliRunner().invoke(main, ["build", str(tmp_path / "no-model"), "-o", str(tmp_path / "e"), *args])
    assert result.exit_code == 1
    assert result.output.startswith(message) and result.output.count("\n") == 1, result.output
