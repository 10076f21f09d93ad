"""Quantization schemes as `kiln build` sees them: names, artifact requirements, clear errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.optimize.quantize import SCHEMES, QuantizationError, check_options, parse_scheme


def test_scheme_names():
    assert {"none", "int8-weight-only", "int4-rtn-g32", "int4-rtn-g64", "int4-rtn-g128", "int4-awq-g128",
            "w8a8-smoothquant"} <= set(SCHEMES)
    assert parse_scheme("int4-awq-g64").group_size == 64 and parse_scheme("int4-awq-g64").calibration == "awq"
    with pytest.raises(QuantizationError, match="unknown quantization 'int3'"):
        parse_scheme("int3")


def test_artifact_requirements():
    assert check_options("int4-rtn-g128", "").calibration is None
    with pytest.raises(QuantizationError, match="needs the scales of `kiln calibrate MODEL --method smoothquant"):
        check_options("w8a8-smoothquant", "")
    with pytest.raises(QuantizationError, match="uses no calibration artifact"):
        check_options("int8-weight-only", "/some/dir")


def test_cli_build_refuses_a_missing_artifact_before_any_work(tmp_path):
    result = CliRunner().invoke(main, ["build", str(tmp_path / "no-model"), "-o", str(tmp_path / "e"),
                                       "--quantization", "int4-awq-g128"])
    assert result.exit_code != 0
    assert "--method awq" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "e").exists()
