"""Sampler: numpy around one op-library kernel per step, vectorized over the rows of a step's logits.

Per row (one sequence): penalties on the raw logits (repetition over prompt + output tokens,
frequency and presence over output tokens), then a structured request's token mask (disallowed
tokens to -inf: runtime/structured/grammar.py), then greedy argmax when temperature is 0;
otherwise logits / temperature, min_p (drop tokens with p < min_p * p_max), top_k (keep the
k largest, ties at the k-th included), top_p (keep the smallest set of most likely tokens
whose mass reaches top_p, ties at its last included), softmax, and one uniform draw from the
sequence's own Generator by inverse CDF in vocabulary order. One draw per sampled token from
a per-sequence Generator, and arithmetic that never mixes rows, make a seeded request's text
independent of whatever else shares its batch. Logprobs are taken from the raw model distribution.

Each filter keeps the tokens whose logit reaches a threshold, so no row is ever sorted: the
thresholds and the draw come from runtime/ops/sampling.cc (min_p in closed form, top_k from
strided group maxima, top_p from a histogram of the weights, the draw over block sums; float64
weights), which reads each row a few times in C instead of the dozen numpy passes a
vectorized selection takes. The filters' definition in plain numpy is the tests' reference.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kiln.runtime.ops import sampling as kernels
from kiln.runtime.params import SamplingParams
from kiln.runtime.sequence import Sequence, TokenCounts
from kiln.runtime.structured.grammar import MaskStep

Floats = npt.NDArray[np.float32]
Doubles = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


class SamplingState(Protocol):
    """What a row's distribution depends on: its request's settings and, for penalties, the token
    counts so far (a Sequence; or a Sequence with speculative tokens counted, during verification)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def token_counts(self) -> TokenCounts | None: ...


@dataclass
class SamplerOutput:
    token_ids: Ints  # [rows]
    sampled_logprobs: list[float | None]  # raw logprob of each sampled token (None: not requested)
    top_logprobs: list[dict[int, tuple[float, int]] | None]  # token -> (logprob, rank), sampled included


@dataclass(frozen=True)
class RowSettings:
    """The sampling settings of the non-greedy rows, one column each."""

    temperature: Doubles  # > 0
    top_k: Ints  # 0: off
    top_p: Doubles  # 1: off
    min_p: Doubles  # 0: off

    def __post_init__(self) -> None:
        if not np.all(self.temperature > 0):
            raise ValueError("temperature must be > 0 for every sampled (non-greedy) row")

    @classmethod
    def of(cls, seqs: SequenceOf[SamplingState]) -> RowSettings:
        params = [s.params for s in seqs]
        return cls(
            np.array([p.temperature for p in params], dtype=np.float64),
            np.array([p.top_k for p in params], dtype=np.int64),
            np.array([p.top_p for p in params], dtype=np.float64),
            np.array([p.min_p for p in params], dtype=np.float64),
        )

    def subset(self, rows: Ints) -> RowSettings:
        return RowSettings(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows])


def apply_penalties(logits: Floats, seqs: SequenceOf[SamplingState]) -> Floats:
    """Repetition (prompt + output tokens), frequency and presence (output tokens) penalties, in place.

    Reads each penalised sequence's token_counts (kept up to date as tokens are appended), so
    the work is one gather and one scatter over the distinct tokens seen, with no copy of the
    token lists.
    """
    rows = [i for i, s in enumerate(seqs) if s.token_counts is not None]
    if not rows:
        return logits
    tallies = [c for i in rows if (c := seqs[i].token_counts) is not None]
    sizes = [len(t) for t in tallies]
    row_of = np.repeat(np.array(rows, dtype=np.int64), sizes)
    ids = np.concatenate([t.ids for t in tallies])
    counts = np.concatenate([t.counts for t in tallies])

    def column(name: str) -> Floats:
        return np.repeat(np.array([getattr(seqs[i].params, name) for i in rows], dtype=np.float32), sizes)

    with np.errstate(divide="ignore", over="ignore"):  # extreme penalties saturate, below
        rep = column("repetition_penalty")
        values = logits[row_of, ids]
        values = np.where(values > 0, values / rep, values * rep)
    values -= column("frequency_penalty") * counts + column("presence_penalty") * (counts > 0)
    # a valid but extreme repetition_penalty (1e-300 is > 0) must not make a logit infinite: the row could not be
    # sampled and its step would fail for every request in it
    limit = np.finfo(np.float32).max
    logits[row_of, ids] = np.clip(values, -limit, limit)
    return logits


def keep_thresholds(logits: Floats, settings: RowSettings) -> Floats:
    """Per row, the logit from which on tokens stay in the distribution after min_p, top_k and
    top_p (the kept set is {logit >= threshold}, so ties at any cut are kept; -inf: no filter)."""
    thresholds, _ = kernels.sample_rows(logits, settings.temperature, settings.top_k, settings.top_p,
                                        settings.min_p, None)
    return thresholds


def filtered_probs(logits: Floats, seqs: SequenceOf[SamplingState]) -> Doubles:
    """The distribution each (non-greedy) row samples from, after temperature/min_p/top_k/top_p."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    settings = RowSettings.of(seqs)
    row_max = logits.max(axis=1)
    thresholds = keep_thresholds(logits, settings)
    scaled = (logits.astype(np.float64) - row_max[:, None]) / settings.temperature[:, None]
    e = np.where(logits >= thresholds[:, None], np.exp(scaled), 0.0)
    probs: Doubles = e / e.sum(axis=1, keepdims=True)
    return probs


def sample(logits: Floats, settings: RowSettings, uniforms: Doubles, threads: int = 1) -> Ints:
    """One token per row from its filtered distribution, by inverse CDF with the row's uniform (rows on up to
    `threads` threads: the same tokens for any count)."""
    _, tokens = kernels.sample_rows(logits, settings.temperature, settings.top_k, settings.top_p, settings.min_p,
                                    uniforms, threads)
    assert tokens is not None
    return tokens


class Sampler:
    def __init__(self, threads: int = 1) -> None:
        """threads: how many threads may sample a step's rows (the engine's: they idle while it samples)."""
        self.threads = threads
        self.masks = MaskStep(threads)

    def __call__(self, logits: npt.ArrayLike, seqs: list[Sequence]) -> SamplerOutput:
        raw: Floats = np.ascontiguousarray(logits, dtype=np.float32)
        assert raw.shape[0] == len(seqs), (raw.shape, len(seqs))
        penalized = any(s.token_counts is not None for s in seqs)
        constrained = any(s.grammar is not None for s in seqs)
        processed = raw.copy() if penalized or constrained else raw
        if penalized:
            apply_penalties(processed, seqs)
        if constrained:  # after the penalties (they never make a token allowed), before every cut-off
            self.masks.settle()  # a prefetched fill reads the matchers until it ends
            for s in seqs:
                if s.grammar is not None:
                    s.grammar.sync(s.token_ids, s.num_prompt_tokens)
            self.masks.apply(processed, [s.grammar for s in seqs])
        if all(s.params.greedy for s in seqs):  # the common step, in one call
            tokens = greedy_tokens(processed)
            return SamplerOutput(tokens, *self.logprobs(raw, tokens, seqs))
        tokens = np.empty(len(seqs), dtype=np.int64)
        greedy = np.array([s.params.greedy for s in seqs], dtype=bool)
        if greedy.any():
            rows = np.flatnonzero(greedy)
            tokens[rows] = greedy_tokens(processed[rows], rows)
        if not greedy.all():
            rows = np.flatnonzero(~greedy)
            sampled = [seqs[i] for i in rows]
            uniforms = np.array([s.rng.random() for s in sampled], dtype=np.float64)
            tokens[rows] = sample(processed if rows.size == len(seqs) else processed[rows], RowSettings.of(sampled),
                                  uniforms, self.threads)
        return SamplerOutput(tokens, *self.logprobs(raw, tokens, seqs))

    @staticmethod
    def logprobs(raw: Floats, tokens: Ints, seqs: SequenceOf[SamplingState]
                 ) -> tuple[list[float | None], list[dict[int, tuple[float, int]] | None]]:
        """Per row, the raw logprob of its token and the top logprobs, for rows whose request asks for them."""
        sampled_lp: list[float | None] = [None] * len(seqs)
        top: list[dict[int, tuple[float, int]] | None] = [None] * len(seqs)
        lp_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if lp_rows:
            ks = [seqs[i].params.logprobs or 0 for i in lp_rows]
            for i, (chosen, best) in zip(lp_rows, raw_logprobs(raw[lp_rows], tokens[lp_rows], ks), strict=True):
                sampled_lp[i], top[i] = chosen, best
        return sampled_lp, top


def greedy_tokens(logits: Floats, rows: Ints | None = None) -> Ints:
    """Each row's argmax; a row holding a NaN or +inf, or no finite logit, raises as sampling it would (argmax
    returns the first NaN or +inf there, or the first -inf of an all -inf row: its logit is not finite). rows:
    the rows' numbers in the step, for the error, when logits are a subset of its rows."""
    tokens: Ints = logits.argmax(axis=1)
    best = logits[np.arange(len(tokens)), tokens]
    if not np.isfinite(best).all():
        bad = int(np.flatnonzero(~np.isfinite(best))[0])
        raise kernels.unsampleable(bad if rows is None else int(rows[bad]))
    return tokens


def raw_logprobs(logits: Floats, tokens: Ints, ks: list[int]) -> list[tuple[float, dict[int, tuple[float, int]]]]:
    """Per row, its token's logprob under the raw model distribution, and {token: (logprob, rank)}
    for that token and the row's k most likely ones (rank 1 = most likely; ties in vocabulary order)."""
    index = np.arange(logits.shape[0])
    row_max = logits.max(axis=1)
    log_total = row_max + np.log(np.exp(logits - row_max[:, None]).sum(axis=1, dtype=np.float64))
    chosen = logits[index, tokens]
    ranks = np.count_nonzero(logits > chosen[:, None], axis=1) + 1
    best_ids, best_logits = kernels.top_tokens(logits, min(max(*ks, 1), logits.shape[1]))
    results = []
    for row, k in enumerate(ks):
        total = float(log_total[row])
        result = {int(tokens[row]): (float(chosen[row]) - total, int(ranks[row]))}
        for rank, (t, value) in enumerate(zip(best_ids[row, :k].tolist(), best_logits[row, :k].tolist(),
                                              strict=True), start=1):
            result.setdefault(t, (value - total, rank))
        results.append((float(chosen[row]) - total, result))
    return results
