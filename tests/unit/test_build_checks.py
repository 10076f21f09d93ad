"""kiln build checks what the model decides before any work: no export starts (and nothing is written)
for a checkpoint without a tokenizer or a context longer than the model's."""

from __future__ import annotations

import pytest

from kiln.manifest import BuildOptions
from kiln.optimize.build import BuildError, build_engine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from helpers import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=512)


def _build_fails(model, out, options: BuildOptions, message: str) -> list[str]:
    said: list[str] = []
    with pytest.raises(BuildError, match=message):
        build_engine(model, out, options, progress=said.append)
    assert not any(line.startswith("export onnx") for line in said), said
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))
    return said


def test_a_checkpoint_without_a_tokenizer_fails_before_the_export(tmp_path, tiny_model):
    import shutil

    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").unlink()
    _build_fails(model, tmp_path / "engine", BuildOptions(), "carries no tokenizer")


def test_a_context_past_max_position_embeddings_is_refused(tmp_path, tiny_model):
    _build_fails(tiny_model, tmp_path / "engine", BuildOptions(max_seq_len=513),
                 r"max_seq_len 513 is longer than the model's context \(max_position_embeddings 512\); "
                 r"build with --max-seq-len 512 or less")


def test_the_cli_names_the_flag(tmp_path, tiny_model):
    from click.testing import CliRunner

    from kiln.cli import main

    result = CliRunner().invoke(main, ["build", str(tiny_model), "-o", str(tmp_path / "e"), "--max-seq-len", "2048"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.splitlines()[-1].startswith("Error: max_seq_len 2048 is longer than the model's context")


def test_a_rope_scaled_context_is_the_default_and_the_limit(tmp_path):
    """YaRN over an original context of 32 with factor 4: the model's context is 128, the default max_seq_len."""
    from helpers import make_tiny_hf_model

    from kiln.export.checkpoint import load_checkpoint
    from kiln.optimize.build import _check_model

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    checkpoint = load_checkpoint(make_tiny_hf_model(tmp_path, "qwen2", max_position_embeddings=32, rope_scaling=yarn))
    assert _check_model(checkpoint, BuildOptions()).max_seq_len == 128
    with pytest.raises(BuildError, match=r"max_seq_len 129 is longer than the model's context \(128: its yarn rope "
                                         r"scaling stretches max_position_embeddings 32\); build with --max-seq-len "
                                         r"128 or less"):
        _check_model(checkpoint, BuildOptions(max_seq_len=129))
