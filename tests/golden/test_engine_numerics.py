"""Golden: the built engine (ONNX Runtime + kiln.PagedAttention) against the PyTorch reference.

One packed prefill step of four prompts, then decode steps with all four in flight, driven
by the minimal numpy driver in tests/engine_driver.py. Every step's logits must match the
ReferenceModel's logits at the same positions (recomputed on the full final sequences, which
is the same thing for a causal model), and greedy decoding must pick the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the key and value cache "
    "in fixed-size blocks, so sequences of very different lengths share one pool without padding. "
)


def prompts(engine_dir, lengths: list[int]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    ids = tokenizer.encode(TEXT * (1 + max(lengths) // 20)).ids
    assert len(ids) >= max(lengths) + len(lengths)
    return [ids[i: i + n] for i, n in enumerate(lengths)]  # different offsets: distinct prompts


def generate(engine_dir, lengths: list[int], steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy-decode all prompts together; returns final sequences and each step's logits [S, V]."""
    from engine_driver import PagedDriver

    driver = PagedDriver(engine_dir / "model.onnx", num_blocks=sum(-(-(n + steps) // 16) for n in lengths) + 4)
    seqs = prompts(engine_dir, lengths)
    logits = [driver.step(list(enumerate(seqs)))]
    for _ in range(steps):
        chosen = logits[-1].argmax(axis=-1)
        for seq, token in zip(seqs, chosen.tolist(), strict=True):
            seq.append(token)
        logits.append(driver.step([(s, [seq[-1]]) for s, seq in enumerate(seqs)]))
    return seqs, logits


def check_against_reference(engine_dir, model_source, lengths: list[int], steps: int, atol: float) -> None:
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.reference import ReferenceModel

    seqs, logits = generate(engine_dir, lengths, steps)
    reference = ReferenceModel.from_checkpoint(load_checkpoint(model_source))
    for s, (seq, prompt_len) in enumerate(zip(seqs, lengths, strict=True)):
        # the engine ran steps+1 steps; the last token it produced was never fed back
        tokens = seq[: prompt_len + steps]
        with torch.no_grad():
            ref = reference(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0].numpy()
        want = ref[prompt_len - 1: prompt_len + steps]  # rows whose logits each step returned
        got = np.stack([step[s] for step in logits])
        err = np.abs(got - want).max()
        assert err <= atol, f"sequence {s} (prompt {prompt_len}): max |logits - reference| = {err:.2e}"
        assert seq[prompt_len:] == want.argmax(axis=-1)[:steps].tolist(), f"sequence {s}: greedy tokens differ"


def test_tiny_engine_matches_reference(tiny_engine, tiny_model_dir):
    check_against_reference(tiny_engine, tiny_model_dir, lengths=[3, 7, 20, 33], steps=6, atol=1e-4)


@pytest.mark.slow
def test_smollm2_engine_matches_reference(smollm2_engine):
    check_against_reference(smollm2_engine, "default", lengths=[7, 64, 200, 513], steps=16, atol=1e-3)


@pytest.mark.parametrize("family, overrides", [
    ("llama", {"num_key_value_heads": 1}),  # MQA
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {"sliding_window": 8}),  # shorter than most prompts: the window masks
], ids=["llama-mqa", "qwen2", "mistral-window8"])
def test_tiny_families_match_reference(tmp_path, family, overrides):
    from helpers import make_tiny_hf_model

    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    model = make_tiny_hf_model(tmp_path, family=family, **overrides)
    # float32 KV: the fp32 pipeline's numerics, held to the reference at 1e-4 (float16 KV: test_build.py)
    build_engine(model, tmp_path / "engine", BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    check_against_reference(tmp_path / "engine", model, lengths=[3, 7, 20, 33], steps=6, atol=1e-4)
