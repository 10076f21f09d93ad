"""Logit error of engines built from one file against a reference engine of the same file (e.g. `--quantization gguf`
and `int4-q4_1` against `gguf-exact`, the file's dequantized weights): one prompt prefilled (every row's logits),
then greedy decode steps, each engine fed the reference's tokens so that every row compares the same context.

    .venv/bin/python benchmarks/scale/logit_error.py REFERENCE_ENGINE ENGINE [ENGINE ...] [--prompt-len 64]
        [--steps 16] [--threads 2]

Per engine: max and mean |logit - reference| over the rows in units of the reference logits' standard deviation,
the mean KL divergence KL(reference || engine) of the softmaxes, and how often the greedy token agrees.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from engine_driver import PagedDriver  # noqa: E402


def logits(engine: Path, prompt: list[int], decode: list[int], threads: int) -> np.ndarray:
    driver = PagedDriver(engine / "model.onnx", num_blocks=64, threads=threads)
    rows = [driver.step([(0, prompt)], all_rows=True)]
    rows += [driver.step([(0, [token])]) for token in decode]
    return np.concatenate(rows).astype(np.float64)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    out: np.ndarray = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path)
    parser.add_argument("engines", type=Path, nargs="+")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 20000, args.prompt_len).tolist()
    # the reference's own greedy continuation, fed to every engine
    driver = PagedDriver(args.reference / "model.onnx", num_blocks=64, threads=args.threads)
    last = driver.step([(0, prompt)])
    decode = []
    for _ in range(args.steps):
        decode.append(int(last[-1].argmax()))
        last = driver.step([(0, [decode[-1]])])
    ref = logits(args.reference, prompt, decode[:-1] if decode else [], args.threads)
    ref_lp = log_softmax(ref)
    scale = ref.std()
    print(f"reference {args.reference.name}: {ref.shape[0]} rows, logit std {scale:.3f}")
    for engine in args.engines:
        got = logits(engine, prompt, decode[:-1] if decode else [], args.threads)
        err = np.abs(got - ref)
        kl = (np.exp(ref_lp) * (ref_lp - log_softmax(got))).sum(-1).mean()
        agree = (got.argmax(-1) == ref.argmax(-1)).mean()
        print(f"{engine.name}: max |dlogit| {err.max() / scale:.4f} std, mean {err.mean() / scale:.5f} std, "
              f"KL {kl:.2e}, top-1 agreement {agree:.3f}", flush=True)


if __name__ == "__main__":
    main()
