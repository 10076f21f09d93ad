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


def generate_chunked(engine_dir, lengths: list[int], steps: int) -> tuple[list[list[int]], list[list[tuple]]]:
    """Greedy-decode the prompts on a schedule of packed ragged steps: prompt 0 prefills in one chunk, the
    others in two, so step 2 mixes prompt 0's first decode with the others' second chunks; then `steps`
    decodes each. Returns the final sequences and, per sequence, (position, logits row) of every step."""
    from engine_driver import PagedDriver

    driver = PagedDriver(engine_dir / "model.onnx", num_blocks=sum(-(-(n + steps) // 16) for n in lengths) + 4)
    seqs = prompts(engine_dir, lengths)
    pending = [[n] if s == 0 else [n // 2, n - n // 2] for s, n in enumerate(lengths)]
    fed = [0] * len(seqs)
    rows: list[list[tuple]] = [[] for _ in seqs]
    while any(fed[s] < n + steps for s, n in enumerate(lengths)):
        chunks = []
        for s, seq in enumerate(seqs):
            if pending[s]:
                chunks.append((s, seq[fed[s]: fed[s] + pending[s].pop(0)]))
            elif fed[s] < lengths[s] + steps:
                chunks.append((s, [seq[-1]]))
        for (s, chunk), row in zip(chunks, driver.step(chunks), strict=True):
            fed[s] += len(chunk)
            rows[s].append((fed[s] - 1, row))
            if fed[s] >= lengths[s]:
                seqs[s].append(int(row.argmax()))
    return seqs, rows


def check_against_transformers(engine_dir, model_dir, lengths: list[int], steps: int, atol: float) -> None:
    """Every step's logits rows equal transformers' (eager, fp32) on the full final sequences; greedy agrees."""
    from helpers import load_hf_reference

    seqs, rows = generate_chunked(engine_dir, lengths, steps)
    hf = load_hf_reference(model_dir)
    for s, (seq, prompt_len) in enumerate(zip(seqs, lengths, strict=True)):
        tokens = seq[: prompt_len + steps]
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None]).logits[0].numpy()
        positions = [pos for pos, _ in rows[s]]
        got = np.stack([row for _, row in rows[s]])
        err = np.abs(got - ref[positions]).max()
        assert err <= atol, f"sequence {s} (prompt {prompt_len}): max |logits - transformers| = {err:.2e}"
        decoded = [pos for pos in positions if pos >= prompt_len - 1]
        assert [seq[pos + 1] for pos in decoded] == ref[decoded].argmax(axis=-1).tolist(), f"sequence {s}: greedy"


SHORT_PROMPTS = [3, 7, 20, 33]
# LongRoPE families at their default context (128, past the original 32): prompts past the original context,
# where transformers uses the long factors on every position.
LONG_PROMPTS = [33, 40, 47, 60]
# YaRN as Qwen2.5 / Qwen3 configs enable it, over an original context of 32: the engine's default context is 128
YARN = {"max_position_embeddings": 32,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}

# Qwen2.5 with use_sliding_window: only layers max_window_layers, ... slide (transformers' Qwen2 semantics)
QWEN_UPPER_WINDOW = {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}


@pytest.mark.parametrize("family, overrides, max_seq_len, lengths", [
    ("llama", {"num_key_value_heads": 1}, None, SHORT_PROMPTS),  # MQA
    ("qwen2", {}, None, SHORT_PROMPTS),  # q/k/v biases
    ("mistral", {"sliding_window": 8}, None, SHORT_PROMPTS),  # shorter than most prompts: the window masks
    ("qwen2", QWEN_UPPER_WINDOW, None, SHORT_PROMPTS),  # layers 0-1 global, 2-3 sliding (max_window_layers)
    ("qwen3", {}, None, SHORT_PROMPTS),  # q/k norm, head_dim 32 != hidden / heads, tied
    ("qwen3", {"tie_word_embeddings": False}, None, SHORT_PROMPTS),
    ("phi3", {}, None, LONG_PROMPTS),  # fused qkv / gate_up, LongRoPE long factors + attention factor
    ("phi4", {}, 32, [3, 7, 12, 20]),  # partial rotary, LongRoPE short factors (context = the original)
    ("phi4", {}, None, LONG_PROMPTS),  # partial rotary, LongRoPE long factors
    ("qwen2", YARN, None, LONG_PROMPTS),  # YaRN frequencies and attention factor, past the original context
    ("qwen3", YARN, None, LONG_PROMPTS),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 4.0}}, None, LONG_PROMPTS),
    # Gemma: sliding windows of 8, shorter than most prompts; chunked prefill and decode run past them
    ("gemma2", {}, None, SHORT_PROMPTS),  # soft-caps, alternating sliding / global layers, head_dim 256
    ("gemma3", {}, None, SHORT_PROMPTS),  # 1B: MQA, q/k norms, 5 local : 1 global, local RoPE base
    ("gemma3-4b", {}, None, SHORT_PROMPTS),  # linear RoPE scaling on the global layers, scalar != head_dim
], ids=["llama-mqa", "qwen2", "mistral-window8", "qwen2-window8-upper-layers", "qwen3", "qwen3-untied", "phi3-long",
        "phi4-short", "phi4-long", "qwen2-yarn", "qwen3-yarn", "llama-linear", "gemma2", "gemma3-1b", "gemma3-4b"])
def test_tiny_families_match_transformers(tmp_path, family, overrides, max_seq_len, lengths):
    from helpers import make_tiny_hf_model

    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine

    model = make_tiny_hf_model(tmp_path, family=family, **overrides)
    # float32 KV: the fp32 pipeline's numerics, held to transformers at 1e-4 (float16 KV: test_build.py)
    build_engine(model, tmp_path / "engine", BuildOptions(kv_dtype="float32", max_seq_len=max_seq_len),
                 progress=lambda _msg: None)
    check_against_transformers(tmp_path / "engine", model, lengths, steps=6, atol=1e-4)
