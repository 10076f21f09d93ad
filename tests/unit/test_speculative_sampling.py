"""Rejection sampling keeps the target's distribution exactly: a chi-square test of the first two
emitted tokens on a tiny model, for a deterministic (n-gram-like) proposer and a sampling draft, at
temperature 1 and with top-p, and the same test failing once the correction step (drawing a
rejected proposal's replacement from the residual max(p - q, 0)) is removed."""

from __future__ import annotations

import math
import sys
from functools import cache

import numpy as np
import pytest

from kiln.runtime.params import SamplingParams
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative.proposer import Proposal
from kiln.runtime.speculative.verify import verify

VOCAB = 6
PROMPT = [1, 4]
K = 2
SAMPLES = 3000


def model_logits(context: list[int], salt: int = 0) -> np.ndarray:
    return _model_logits(tuple(context), salt)


@cache
def _model_logits(context: tuple[int, ...], salt: int) -> np.ndarray:
    """A tiny context-dependent model (salt 1 is the draft: another model, close to the target)."""
    h = sum((t + 1) * (i + 3) for i, t in enumerate(context)) + 7 * salt
    v = np.arange(VOCAB)
    return (1.5 * np.sin(0.9 * v * (h % 5 + 1) + h * 0.37) + 0.4 * salt * np.cos(v + h)).astype(np.float32)


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The target's sampling distribution written out plainly: softmax(logits / T), then top-p by a full sort."""
    p = np.exp((logits - logits.max()) / params.temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    kept = np.zeros(VOCAB, dtype=bool)
    kept[order[before < params.top_p]] = True
    p = np.where(kept, p, 0)
    return p / p.sum()


def target_pair_probs(params: SamplingParams) -> np.ndarray:
    first = reference_probs(model_logits(PROMPT), params)
    pairs = np.zeros((VOCAB, VOCAB))
    for a in range(VOCAB):
        pairs[a] = first[a] * reference_probs(model_logits(PROMPT + [a]), params)
    return pairs


def one_hot_proposal(context: list[int], rng: np.random.Generator) -> Proposal:
    """The target's second most likely token at each position: deterministic, plausible, often wrong."""
    tokens: list[int] = []
    for _ in range(K):
        tokens.append(int(np.argsort(-model_logits(context + tokens))[1]))
    return Proposal(tuple(tokens))


def draft_proposal(context: list[int], rng: np.random.Generator) -> Proposal:
    """Tokens sampled from another model's softmax, with the distributions they came from."""
    tokens: list[int] = []
    rows = []
    for _ in range(K):
        q = np.exp(model_logits(context + tokens, salt=1).astype(np.float64))
        q /= q.sum()
        rows.append(q)
        tokens.append(int(rng.choice(VOCAB, p=q)))
    return Proposal(tuple(tokens), np.array(rows))


def sample_pairs(params: SamplingParams, propose, seed: int) -> np.ndarray:
    """Counts of the first two emitted tokens over SAMPLES runs of propose -> verify."""
    rng, draft_rng = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    counts = np.zeros((VOCAB, VOCAB))
    for _ in range(SAMPLES):
        out: list[int] = []
        while len(out) < 2:
            context = PROMPT + out
            proposal = propose(context, draft_rng)
            logits = np.stack([model_logits(context + list(proposal.token_ids[:j])) for j in range(K + 1)])
            seq = Sequence(PROMPT, params, rng=rng)
            seq.token_ids = list(context)
            out += verify(seq, logits, proposal).token_ids
        counts[out[0], out[1]] += 1
    return counts


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Upper tail of Pearson's statistic over the cells with mass (Wilson-Hilferty approximation)."""
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    mask = probs > 0
    expected = probs[mask] * counts.sum()
    stat = float((((counts[mask] - expected) ** 2) / expected).sum())
    df = int(mask.sum()) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.75)]
PROPOSERS = [one_hot_proposal, draft_proposal]


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "top_p"])
@pytest.mark.parametrize("propose", PROPOSERS, ids=["one_hot", "draft"])
def test_emitted_tokens_follow_the_target_distribution(params, propose):
    probs = target_pair_probs(params)
    assert chi_square_p_value(sample_pairs(params, propose, seed=3), probs) > 1e-3


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "top_p"])
@pytest.mark.parametrize("propose", PROPOSERS, ids=["one_hot", "draft"])
def test_the_test_fails_without_the_correction_step(monkeypatch, params, propose):
    """Replacing a rejected proposal with a plain draw from p (no residual) biases the output towards
    the proposals: the chi-square test above must see it."""
    monkeypatch.setattr(sys.modules["kiln.runtime.speculative.verify"], "residual", lambda p, q, token: p)
    probs = target_pair_probs(params)
    assert chi_square_p_value(sample_pairs(params, propose, seed=3), probs) < 1e-6


def test_greedy_verification_keeps_the_matching_prefix_and_adds_the_argmax():
    logits = np.zeros((4, VOCAB), dtype=np.float32)
    logits[[0, 1, 2, 3], [2, 5, 1, 3]] = 1.0  # the target's choices: 2, 5, 1, then bonus 3
    seq = Sequence(PROMPT, SamplingParams(temperature=0))
    assert verify(seq, logits, Proposal((2, 5, 1))).token_ids == [2, 5, 1, 3]
    got = verify(seq, logits, Proposal((2, 4, 1)))
    assert (got.token_ids, got.num_accepted) == ([2, 5], 1)
    got = verify(seq, logits, Proposal((0, 5, 1)))
    assert (got.token_ids, got.num_accepted) == ([2], 0)


def test_penalties_see_the_kept_proposals():
    """Row j's repetition penalty counts the proposals kept before it, as plain decoding would."""
    params = SamplingParams(temperature=0, repetition_penalty=4.0)
    logits = np.zeros((3, VOCAB), dtype=np.float32)
    logits[:, 2] = 2.0  # 2 is the favourite everywhere ...
    logits[:, 3] = 1.0  # ... until it has been emitted once: 2/4 < 1
    seq = Sequence(PROMPT, params)
    got = verify(seq, logits, Proposal((2, 2)))
    assert (got.token_ids, got.num_accepted) == ([2, 3], 1)
    assert seq.token_counts is not None and seq.token_counts.counts.sum() == 0  # the sequence is untouched
