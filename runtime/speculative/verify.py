"""Verification: which proposed tokens the target keeps, and the token it adds after them.

The target computed logits for k + 1 rows of a sequence: row j follows the sequence's tokens and the
first j proposals. Greedy requests keep the longest prefix of proposals that match the argmax, then
add the argmax of the first row that differs (or of the last row: the bonus token). Sampled requests
use rejection sampling (Leviathan et al. 2023; Chen et al. 2023), which leaves every emitted token
distributed exactly as the target's own sampling would be: proposal x drawn from q is kept with
probability min(1, p(x) / q(x)), where p is the target's row after penalties, temperature, min_p,
top_k and top_p (the distribution plain decoding samples from); on rejection the replacement is drawn
from the residual max(p - q, 0), renormalised. A deterministic proposer (n-gram) has q one-hot on x:
x is kept with probability p(x), and the residual is p without x.

Penalties depend on the tokens before each row, so a penalised request's rows are processed one by
one on a tally that counts the proposals kept so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kiln.runtime.params import SamplingParams
from kiln.runtime.sampler import Doubles, Floats, apply_penalties, filtered_probs, greedy_tokens
from kiln.runtime.sequence import Sequence, TokenCounts
from kiln.runtime.speculative.proposer import Proposal


@dataclass(frozen=True)
class Verdict:
    token_ids: list[int]  # the kept proposals, then the target's own next token
    num_accepted: int  # how many proposals were kept


@dataclass
class SpecStats:
    """Running totals of an engine's verifications."""

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.verifications += 1
        self.proposed += num_proposed
        self.accepted += num_accepted


class _Tally:
    """A sequence's sampling state with the kept proposals counted (for penalties)."""

    def __init__(self, seq: Sequence) -> None:
        self.params: SamplingParams = seq.params
        self.token_counts: TokenCounts | None = None if seq.token_counts is None else seq.token_counts.copy()

    def add(self, token: int) -> None:
        if self.token_counts is not None:
            self.token_counts.add(token)


def draw(weights: Doubles, u: float) -> int:
    """Inverse CDF over non-negative weights with one uniform in [0, 1); never a zero-weight token."""
    cumulative = np.cumsum(weights)
    target = max(u * float(cumulative[-1]), np.finfo(np.float64).tiny)
    index = int(np.count_nonzero(cumulative < target))
    return min(index, int(np.flatnonzero(weights > 0)[-1]))


def residual(p: Doubles, q: Doubles | None, token: int) -> Doubles:
    """Where a rejected proposal's replacement is drawn from: max(p - q, 0) (unnormalised); q None is
    one-hot on `token`, so the residual is p without it."""
    if q is None:
        rest = p.copy()
        rest[token] = 0.0
    else:
        rest = np.maximum(p - q, 0.0)
    return rest if rest.sum() > 0 else p  # only when p == q, where a rejection cannot happen


def verify(seq: Sequence, logits: npt.ArrayLike, proposal: Proposal) -> Verdict:
    """Keep a prefix of proposal (k tokens) given the target's raw logits [k + 1, vocab] for seq's rows."""
    raw: Floats = np.ascontiguousarray(logits, dtype=np.float32)
    proposed, q = proposal.token_ids, proposal.probs
    k = len(proposed)
    assert raw.shape[0] == k + 1, (raw.shape, k)
    greedy, rng = seq.params.greedy, seq.rng
    tally = _Tally(seq)
    penalized = tally.token_counts is not None
    if not penalized:  # rows do not depend on the kept tokens: all at once
        best = greedy_tokens(raw) if greedy else None
        probs = None if greedy else filtered_probs(raw, [tally] * (k + 1))
    kept: list[int] = []
    for j in range(k + 1):
        if penalized:
            row = apply_penalties(raw[j:j + 1].copy(), [tally])
            best_j = int(greedy_tokens(row)[0]) if greedy else -1
            p_j = None if greedy else filtered_probs(row, [tally])[0]
        else:
            best_j = int(best[j]) if best is not None else -1
            p_j = None if probs is None else probs[j]
        if j == k:  # every proposal kept: the bonus token
            return Verdict(kept + [best_j if p_j is None else draw(p_j, rng.random())], k)
        token = proposed[j]
        if p_j is None:
            if best_j != token:
                return Verdict(kept + [best_j], j)
        else:
            q_j = None if q is None else q[j]
            keep = p_j[token] if q_j is None else min(1.0, p_j[token] / q_j[token])
            if rng.random() >= keep:
                return Verdict(kept + [draw(residual(p_j, q_j, token), rng.random())], j)
        kept.append(token)
        tally.add(token)
    raise AssertionError("unreachable: the loop returns at j == k")
