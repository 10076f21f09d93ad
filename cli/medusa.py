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
@click.option("--answers-from", "engine", type=click.Path(exists=True, file_okay=False), default=None,
              help="an fp32 engine dir of MODEL: train on the model's own greedy answers to chat prompts, generated "
                   "by the runtime (--prompt-source), instead of continuations of the calibration book")
@click.option("--prompt-source", type=click.Choice(["mixed", "self", "templates"]), default="mixed",
              show_default=True,
              help="with --answers-from: self, user turns the model writes itself after its chat template's opening "
                   "(its own chat distribution); templates, open questions over a dictionary's headwords and the "
                   "corpus's chat requests; mixed, half of each")
@click.option("--prompts", type=int, default=None,
              help="prompts: of each kind (text windows, chat requests) from the book [24]; or chat prompts with "
                   "--answers-from [200]; 1 in 8 held out")
@click.option("--new-tokens", type=int, default=None, help="greedy tokens generated per prompt [48; 64 with "
                                                           "--answers-from]")
@click.option("--epochs", type=int, default=None,
              help="training epochs [5; 3 with --answers-from]; the heads kept are the best held-out epoch's")
@click.option("--weight-decay", type=float, default=0.0, show_default=True,
              help="AdamW weight decay (pulls the heads toward the shared LM head)")
@click.option("--answer-cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="with --answers-from: a .jsonl file of answers, reused and extended (an interrupted or longer "
                   "run pays only for new prompts)")
@click.option("--rows-cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="with --answers-from: a torch file of the answers' teacher-forced hidden states, written once and "
                   "reused while it fits the answers and the model (checked)")
@click.option("--kind", type=click.Choice(["medusa", "hydra"]), default="medusa", show_default=True,
              help="medusa: each head guesses from the hidden state alone; hydra: each head also reads the token "
                   "before the one it guesses (a chain, run after the step on the token actually chosen)")
@click.option("--draft-vocabulary", type=int, default=8192, show_default=True,
              help="hydra: the most frequent answer tokens the heads' guesses range over")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help="threads of the runtime generating the answers")
def train_medusa(model: str, output: Path, num_heads: int, engine: str | None, prompts: int | None,
                 new_tokens: int | None, epochs: int | None, weight_decay: float, answer_cache: Path | None,
                 rows_cache: Path | None, prompt_source: str, kind: str, draft_vocabulary: int, seed: int,
                 threads: int | None) -> None:
    """Train Medusa heads for MODEL on its own greedy continuations: of chat prompts (--answers-from) or of
    the calibration book."""
    import torch

    from kiln.corpus import CALIBRATION_BOOK, calibration_text
    from kiln.corpus.debian import CorpusNotFound
    from kiln.export.checkpoint import load_checkpoint
    from kiln.heads.medusa_train import ChatAnswers, MedusaConfig, train_medusa_chat
    from kiln.heads.medusa_train import train_medusa as run

    chat = engine is not None
    for name, cache in (("--answer-cache", answer_cache), ("--rows-cache", rows_cache)):
        if cache is not None and not chat:
            raise click.UsageError(f"{name} needs --answers-from (it caches that engine's answers or their rows)")
    config = MedusaConfig(num_heads=num_heads, text_prompts=prompts or 24, chat_prompts=prompts or 24,
                          new_tokens=new_tokens or (64 if chat else 48), epochs=epochs or (3 if chat else 5),
                          seed=seed, label_vocabulary=chat, weight_decay=weight_decay, kind=kind,
                          draft_vocabulary=draft_vocabulary)
    try:
        checkpoint = load_checkpoint(model)
        text = None if chat else calibration_text()
    except (CorpusNotFound, FileNotFoundError, ValueError) as exc:  # each names the problem in one sentence
        raise click.ClickException(str(exc)) from exc
    _say(f"{config.num_heads} {config.kind} heads, {torch.get_num_threads()} threads, seed {config.seed}")
    if engine is not None:
        try:
            source = ChatAnswers(engine, prompts or 200, threads, answer_cache, rows_cache, prompt_source)
            artifact = train_medusa_chat(checkpoint, source, config, _say)
        except ValueError as exc:  # an answer or rows cache that does not fit: the message says which
            raise click.ClickException(str(exc)) from exc
    else:
        assert text is not None
        artifact = run(checkpoint, text, config, _say, corpus=f"janeaustenr:{CALIBRATION_BOOK}")
    _say(f"wrote {artifact.save(output)} in {artifact.info['seconds']['total']:.0f}s")
