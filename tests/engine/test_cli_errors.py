"""The CLI reports problems a user can fix in one line, not a traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kiln.cli import main


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_missing_model_is_one_line(tmp_path):
    result = _run("build", str(tmp_path / "nope"), "-o", str(tmp_path / "engine"))
    assert result.exit_code == 1
    assert "Error:" in result.output and "no such file or directory" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_unsupported_architecture_names_it_and_what_kiln_supports(tmp_path, source):
    """An OLMo 2 checkpoint (or a GGUF of an architecture kiln does not read) fails in one line that names
    the architecture and lists the Hugging Face and GGUF architectures kiln compiles."""
    import json

    from helpers import make_tiny_hf_model
    from tiny_gguf import make_tiny_gguf

    if source == "hf":
        model = make_tiny_hf_model(tmp_path, "llama")
        config = json.loads((model / "config.json").read_text())
        config.update(architectures=["Olmo2ForCausalLM"], model_type="olmo2")
        (model / "config.json").write_text(json.dumps(config))
        named = "Olmo2ForCausalLM"
    else:
        model, _ = make_tiny_gguf(tmp_path, "llama", architecture="olmo2")
        named = "'olmo2'"
    result = _run("build", str(model), "-o", str(tmp_path / "engine"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    message = result.output.strip().splitlines()[-1]  # after the build's progress lines
    kind = "" if source == "hf" else "GGUF "
    assert message.startswith("Error: ") and f"unsupported {kind}architecture {named}" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "llama, qwen2, qwen3, phi3, gemma2, gemma3"):
        assert name in message


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


def _build_raising(monkeypatch, exc: Exception) -> None:
    def build_engine(*_args, **_kwargs):
        raise exc

    monkeypatch.setattr("kiln.optimize.build.build_engine", build_engine)


def test_kiln_error_is_one_line_and_kiln_debug_keeps_the_traceback(monkeypatch, tmp_path):
    from kiln.optimize.build import BuildError

    _build_raising(monkeypatch, BuildError("the graph lacks the inputs ['logits_indices']"))
    result = _run("build", str(tmp_path), "-o", str(tmp_path / "engine"))
    assert result.exit_code == 1 and result.output == "Error: the graph lacks the inputs ['logits_indices']\n"
    monkeypatch.setenv("KILN_DEBUG", "1")
    with pytest.raises(BuildError, match="logits_indices"):
        CliRunner().invoke(main, ["build", str(tmp_path), "-o", str(tmp_path / "engine")], catch_exceptions=False)


@pytest.mark.parametrize("bug", [ValueError("operands could not be broadcast together"), RuntimeError("oops"),
                                 KeyError("layer")])
def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path, bug):
    """Only a KilnError is a user's problem: a builtin error escapes main, so Python prints its traceback."""
    _build_raising(monkeypatch, bug)
    with pytest.raises(type(bug)):
        CliRunner().invoke(main, ["build", str(tmp_path), "-o", str(tmp_path / "engine")], catch_exceptions=False)


def _copy(tiny_engine, tmp_path):
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    return engine


def test_a_corrupt_tokenizer_the_manifest_vouches_for_is_one_line(tiny_engine, tmp_path):
    """A tokenizer.json broken before the checksums were taken (or with them rewritten) still fails in one line."""
    from kiln.manifest import read_manifest, write_manifest

    engine = _copy(tiny_engine, tmp_path)
    (engine / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    write_manifest(engine, read_manifest(engine, verify_checksums=False))
    result = _run("generate", str(engine), "hello")
    assert result.exit_code == 1 and len(result.output.splitlines()) == 1
    assert result.output.startswith("Error: engine file tokenizer.json is not a valid tokenizer (")


def test_a_weights_file_the_manifest_does_not_list_is_refused(tiny_engine, tmp_path):
    """model.onnx.data dropped from the manifest's checksums and a byte flipped: it must not load and generate."""
    import json

    engine = _copy(tiny_engine, tmp_path)
    manifest = json.loads((engine / "manifest.json").read_text())
    del manifest["files"]["model.onnx.data"]
    (engine / "manifest.json").write_text(json.dumps(manifest))
    with open(engine / "model.onnx.data", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x40]))
    result = _run("generate", str(engine), "hello", "--max-tokens", "2")
    assert result.exit_code == 1
    assert result.output == ("Error: engine file model.onnx.data is not checksummed by manifest.json and kiln loads "
                             "only checksummed engine files; remove it or rebuild the engine\n")
