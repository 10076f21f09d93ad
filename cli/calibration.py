"""``kiln calibrate`` (registered on the kiln click group in cli/commands.py).

Heavy imports (torch, the exporter) happen inside the commands: ``kiln --help`` stays light.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


def _say(message: str) -> None:
    print(f"[kiln] {message}", file=sys.stderr, flush=True)


def _say_above_bars(message: str) -> None:
    """`kiln calibrate`'s messages, between its progress bars."""
    from kiln.export.progress import print_above_bars

    print_above_bars(f"[kiln] {message}")


@click.command()
@click.argument("model")
@click.option("--method", type=click.Choice(["smoothquant", "awq"]), required=True)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="artifact directory to write")
@click.option("--alpha", type=float, default=None, help="SmoothQuant migration strength (default: searched per layer)")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="128", show_default=True,
              help="AWQ: the int4 group size to search scales for")
@click.option("--clip/--no-clip", default=True, show_default=True,
              help="AWQ: also search per-group weight clip ratios (AWQ's auto_clip)")
@click.option("--tune-norms/--no-tune-norms", default=True, show_default=True,
              help="AWQ: then train the norm gains of the int4-simulated model against fp32 (KL), end to end")
@click.option("--int8-fallback", type=click.IntRange(min=0), default=None,
              help="AWQ: keep the N decoder units (fused q/k/v, o, gate/up, down) whose int4 rounding costs the "
                   "most loss int8 per channel; 0 for none  [default: one unit in 4]")
@click.option("--rounding", type=click.Choice(["gptq", "rtn"]), default="gptq", show_default=True,
              help="AWQ: round the int4 weights by GPTQ on the calibration inputs' Hessians, or to nearest")
@click.option("--windows", type=int, default=16, show_default=True, help="calibration windows")
@click.option("--window-tokens", type=int, default=512, show_default=True, help="tokens per window")
@click.option("--calibration-text", type=click.Path(exists=True, path_type=Path), default=None,
              help="UTF-8 FILE, or DIR of them, to calibrate on instead of the mixed corpus (your own domain)")
def calibrate(model: str, method: str, output: Path, alpha: float | None, group_size: str, clip: bool,
              tune_norms: bool, int8_fallback: int | None, rounding: str, windows: int, window_tokens: int,
              calibration_text: Path | None) -> None:
    """Collect activation statistics of MODEL on the corpus's calibration split (prose, technical, code and
    chat windows in equal shares) or on --calibration-text, and write scales to OUTPUT."""
    from kiln.calibration.calibrate import CalibrationConfig, calibrate_windows, corpus_windows
    from kiln.corpus.debian import CorpusNotFound
    from kiln.export.checkpoint import load_checkpoint

    config = CalibrationConfig(method, windows, window_tokens, alpha=alpha, group_size=int(group_size),
                               clip=clip, tune_norms=tune_norms, int8_fallback=int8_fallback,
                               rounding=rounding)
    try:
        checkpoint = load_checkpoint(model)
    except (FileNotFoundError, ValueError) as exc:  # the exporter names an unusable model source in one sentence
        raise click.ClickException(str(exc)) from exc
    try:
        token_windows, manifest = corpus_windows(checkpoint, config, calibration_text)
    except CorpusNotFound as exc:
        raise click.ClickException(str(exc)) from exc
    _say("calibration windows: " + ", ".join(f"{d} {m['windows']}" for d, m in manifest["domains"].items()))
    artifact = calibrate_windows(checkpoint, token_windows, config, _say_above_bars, corpus=manifest)
    _say(f"wrote {artifact.save(output)}")
