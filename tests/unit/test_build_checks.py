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
