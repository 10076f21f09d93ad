"""``kiln train-medusa`` (registered on the kiln click group in cli/commands.py).

torch and the trainer load inside the command: ``kiln --help`` stays light.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


def _say(message: str) -> None:
    print(f"[kiln train-medusa] {message}", file=sys.stderr, flush=True)


@click.command(name="train-medusa")
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="heads directory to write")
@click.option("--num-heads", type=int, default=4, show_default=True, help="K: head i guesses the token i steps ahead")
@click.option("--prompts", type=int, default=24, show_default=True,
              help="calibration-text prompts of each kind (text windows, chat requests); 1 in 8 held out")
@click.option("--new-tokens", type=int, default=48, show_default=True, help="greedy tokens generated per prompt")
@click.option("--epochs", type=int, default=5, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train_medusa(model: str, output: Path, num_heads: int, prompts: int, new_tokens: int, epochs: int,
                 seed: int) -> None:
    """Train Medusa heads for MODEL on its own greedy continuations of the calibration text."""
    import torch

    from kiln.calibration.corpus import CALIBRATION_BOOK, calibration_text
    from kiln.calibration.debian import CorpusNotFound
    from kiln.calibration.medusa_train import MedusaConfig
    from kiln.calibration.medusa_train import train_medusa as run
    from kiln.export.checkpoint import load_checkpoint

    config = MedusaConfig(num_heads=num_heads, text_prompts=prompts, chat_prompts=prompts, new_tokens=new_tokens,
                          epochs=epochs, seed=seed)
    try:
        text = calibration_text()
        checkpoint = load_checkpoint(model)
    except (CorpusNotFound, FileNotFoundError, ValueError) as exc:  # each names the problem in one sentence
        raise click.ClickException(str(exc)) from exc
    _say(f"{config.num_heads} heads, {torch.get_num_threads()} threads, seed {config.seed}")
    artifact = run(checkpoint, text, config, _say, corpus=f"janeaustenr:{CALIBRATION_BOOK}")
    _say(f"wrote {artifact.save(output)} in {artifact.info['seconds']['total']:.0f}s")
