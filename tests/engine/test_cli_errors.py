"""The CLI reports problems a user can fix in one line, not a traceback."""

from __future__ import annotations

from click.testing import CliRunner

from kiln.cli import main


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_missing_model_is_one_line(tmp_path):
    result = _run("build", str(tmp_path / "nope"), "-o", str(tmp_path / "engine"))
    assert result.exit_code == 1
    assert "Error:" in result.output and "no such file or directory" in result.output
    assert "Traceback" not in result.output


def test_directory_without_manifest_is_one_line(tmp_path):
    result = _run("generate", str(tmp_path), "hello")
    assert result.exit_code == 1
    assert "is not a kiln engine directory" in result.output
    assert "Traceback" not in result.output


def test_corrupted_engine_file_is_one_line(tiny_engine, tmp_path):
    import shutil

    broken = tmp_path / "engine"
    shutil.copytree(tiny_engine, broken)
    with open(broken / "tokenizer.json", "a") as f:
        f.write(" ")
    result = _run("generate", str(broken), "hello")
    assert result.exit_code == 1
    assert "tokenizer.json is corrupted" in result.output
