"""Sampler: numpy, vectorized over the rows of a step's logits.

Per row (one sequence): penalties on the raw logits (repetition over prompt + output tokens,
frequency and presence over output tokens), then greedy argmax when temperature is 0;
otherwise logits / temperature, min_p (drop tokens with p < min_p * p_max), top_k (keep the
k largest, ties at the k-th included), top_p (keep the smallest set of most likely tokens
whose mass reaches top_p), softmax, and one uniform draw from the sequence's own Generator
by inverse CDF. One draw per sampled token from a per-sequence Generator makes a seeded
request's text independent of whatever else shares its batch. Logprobs are taken from the
raw model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kiln.runtime.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # int64 [rows]
    sampled_logprobs: list[float | None]  # raw logprob of each sampled token (None: not requested)
    top_logprobs: list[dict[int, tuple[float, int]] | None]  # token -> (logprob, rank), sampled included


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    result: np.ndarray = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return result


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    result: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return result


def _column(seqs: list[Sequence], name: str, dtype: npt.DTypeLike = np.float32) -> np.ndarray:
    return np.array([getattr(s.params, name) for s in seqs], dtype=dtype)


def apply_penalties(logits: np.ndarray, seqs: list[Sequence]) -> np.ndarray:
    """Repetition (prompt + output tokens), frequency and presence (output tokens) penalties, in place."""
    rep = _column(seqs, "repetition_penalty")
    freq = _column(seqs, "frequency_penalty")
    pres = _column(seqs, "presence_penalty")
    rows = np.flatnonzero((rep != 1) | (freq != 0) | (pres != 0))
    if rows.size == 0:
        return logits
    vocab = logits.shape[1]
    counts = np.zeros((rows.size, vocab), dtype=np.float32)  # output-token counts
    seen = np.zeros((rows.size, vocab), dtype=bool)  # prompt or output
    for j, i in enumerate(rows):
        seq = seqs[i]
        out = np.asarray(seq.output_token_ids, dtype=np.int64)
        np.add.at(counts[j], out, 1)
        seen[j, np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype=np.int64)] = True
    seen |= counts > 0
    sub = logits[rows]
    r = rep[rows, None]
    sub = np.where(seen, np.where(sub > 0, sub / r, sub * r), sub)
    sub -= freq[rows, None] * counts + pres[rows, None] * (counts > 0)
    logits[rows] = sub
    return logits


def filtered_probs(logits: np.ndarray, seqs: list[Sequence]) -> np.ndarray:
    """The distribution each (non-greedy) row samples from, after temperature/min_p/top_k/top_p."""
    temp = _column(seqs, "temperature")
    x = logits / temp[:, None]
    min_p = _column(seqs, "min_p")
    if np.any(min_p > 0):
        p = softmax(x)
        x = np.where(p < min_p[:, None] * p.max(axis=1, keepdims=True), -np.inf, x)
    top_k = _column(seqs, "top_k", np.int64)
    top_p = _column(seqs, "top_p")
    if np.any(top_k > 0) or np.any(top_p < 1):
        vocab = x.shape[1]
        desc = -np.sort(-x, axis=1)
        k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
        kth = desc[np.arange(len(seqs)), k - 1]
        desc = np.where(desc >= kth[:, None], desc, -np.inf)
        x = np.where(x >= kth[:, None], x, -np.inf)
        if np.any(top_p < 1):
            p_desc = softmax(desc)
            before = np.cumsum(p_desc, axis=1) - p_desc  # mass strictly before each token
            keep = before < top_p[:, None]
            last = keep.sum(axis=1) - 1
            thresh = desc[np.arange(len(seqs)), last]
            x = np.where(x >= thresh[:, None], x, -np.inf)
    return softmax(x)


def inverse_cdf(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(probs, axis=1)
    idx = (cdf < uniforms[:, None] * cdf[:, -1:]).sum(axis=1)
    rows: np.ndarray = np.minimum(idx, probs.shape[1] - 1)
    return rows


class Sampler:
    def __call__(self, logits: np.ndarray, seqs: list[Sequence]) -> SamplerOutput:
        assert logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        raw = np.asarray(logits, dtype=np.float32)
        processed = apply_penalties(raw.copy(), seqs)
        tokens = processed.argmax(axis=1).astype(np.int64)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            sub = [seqs[i] for i in random_rows]
            probs = filtered_probs(processed[random_rows], sub)
            uniforms = np.array([s.rng.random() for s in sub])
            tokens[random_rows] = inverse_cdf(probs, uniforms)
        sampled_lp: list[float | None] = [None] * len(seqs)
        top: list[dict[int, tuple[float, int]] | None] = [None] * len(seqs)
        lp_rows = [(i, k) for i, s in enumerate(seqs) if (k := s.params.logprobs) is not None]  # (row, top k)
        if lp_rows:
            logp = log_softmax(raw[[i for i, _ in lp_rows]])
            for j, (i, k) in enumerate(lp_rows):
                sampled_lp[i], top[i] = _logprobs(logp[j], int(tokens[i]), k)
        return SamplerOutput(tokens, sampled_lp, top)


def _logprobs(logp: np.ndarray, token: int, k: int) -> tuple[float, dict[int, tuple[float, int]]]:
    chosen = float(logp[token])
    result = {token: (chosen, int((logp > logp[token]).sum()) + 1)}
    if k > 0:
        best = np.argpartition(-logp, k - 1)[:k]
        best = best[np.argsort(-logp[best], kind="stable")]
        for rank, t in enumerate(best.tolist(), start=1):
            result.setdefault(t, (float(logp[t]), rank))
    return chosen, result
