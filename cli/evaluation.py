"""``kiln eval`` (registered on the kiln click group in cli/commands.py).

The evaluation imports happen inside the command: ``kiln --help`` stays light.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


def _say(message: str) -> None:
    print(f"[kiln] {message}", file=sys.stderr, flush=True)  # no progress bars here: `kiln eval` runs without tqdm


@click.command(name="eval")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--reference", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="fp32 engine of the same model, for greedy agreement")
@click.option("--windows", type=int, default=16, show_default=True,
              help="perplexity windows of --window-tokens per domain")
@click.option("--window-tokens", type=int, default=512, show_default=True)
@click.option("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="UTF-8 text file to measure on instead of the corpus's domains (e.g. your own domain)")
@click.option("--split", type=click.Choice(["evaluation", "validation"]), default="evaluation", show_default=True,
              help="corpus split: validation is the one to choose methods and hyperparameters on")
@click.option("--score-second-half", is_flag=True,
              help="score only each window's second half, as llama.cpp's llama-perplexity does with -c equal to "
                   "--window-tokens (compare with --text on the same file)")
def evaluate(engine_dir: Path, reference: Path | None, windows: int, window_tokens: int, threads: int | None,
             text_file: Path | None, split: str, score_second_half: bool) -> None:
    """Perplexity per domain (prose, technical, code, chat) on the corpus's evaluation split, greedy
    agreement with --reference, decode tok/s, size."""
    from kiln.corpus.debian import CorpusNotFound
    from kiln.evaluation.evaluate import EvalOptions
    from kiln.evaluation.evaluate import evaluate as run

    options = EvalOptions(reference, windows, window_tokens, threads, text_file, split, score_second_half)
    try:
        report = run(engine_dir, options, _say)
    except (CorpusNotFound, UnicodeDecodeError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(report.to_json())
