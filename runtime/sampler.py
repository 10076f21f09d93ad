"""Sampler: numpy, vectorized over the rows of a step's logits, without sorting the vocabulary.

Per row (one sequence): penalties on the raw logits (repetition over prompt + output tokens,
frequency and presence over output tokens), then greedy argmax when temperature is 0;
otherwise logits / temperature, min_p (drop tokens with p < min_p * p_max), top_k (keep the
k largest, ties at the k-th included), top_p (keep the smallest set of most likely tokens
whose mass reaches top_p, ties at its last included), softmax, and one uniform draw from the
sequence's own Generator by inverse CDF in vocabulary order. One draw per sampled token from
a per-sequence Generator, and arithmetic that never mixes rows, make a seeded request's text
independent of whatever else shares its batch. Logprobs are taken from the raw model distribution.

Each filter keeps the tokens whose logit reaches a threshold, so the sampler finds one
threshold per row and never sorts the vocabulary: min_p's is max + T·log(min_p); top_k's and
top_p's come from the row's largest logits (the candidates), found through the maxima of
strided groups of the row and sorted alone. top_p's nucleus needs the mass of the tokens above
top_k and min_p; when the candidates do not hold the whole nucleus the row is tried again
with WIDEN times as many, up to a full sort, so the distribution is exact, never an approximation.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kiln.runtime.params import SamplingParams
from kiln.runtime.sequence import Sequence, TokenCounts

Floats = npt.NDArray[np.float32]
Doubles = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

FIRST_WIDTH = 512  # candidates per row at first; unresolved top_p rows retry with WIDEN times as many
WIDEN = 8
GROUPS_PER_CANDIDATE = 8  # strided groups per wanted candidate: more groups, fewer surplus candidates
MIN_GROUPS = 1024
MAX_PADDED = 4096  # rows keeping more tokens than this sample over the full row, in blocks
BLOCK = 256  # tokens per block of the full-row inverse CDF


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

    rep = column("repetition_penalty")
    values = logits[row_of, ids]
    values = np.where(values > 0, values / rep, values * rep)
    values -= column("frequency_penalty") * counts + column("presence_penalty") * (counts > 0)
    logits[row_of, ids] = values
    return logits


def _float32_at_least(x: Doubles) -> Floats:
    """The smallest float32 >= x, so that `logit >= result` holds exactly when `logit >= x` does."""
    rounded = x.astype(np.float32)
    return np.where(rounded < x, np.nextafter(rounded, np.float32(np.inf)), rounded).astype(np.float32)


def _group_maxima(logits: Floats, num_groups: int) -> Floats:
    """The maximum of each of num_groups strided groups (token j in group j % num_groups) of every
    row, plus the tail that does not fill a whole stride as groups of one; a strided view, no copy."""
    rows, vocab = logits.shape
    body = vocab - vocab % num_groups
    view = np.lib.stride_tricks.as_strided(
        logits, shape=(rows, body // num_groups, num_groups),
        strides=(logits.strides[0], num_groups * logits.strides[1], logits.strides[1]), writeable=False,
    )
    maxima: Floats = view.max(axis=1)
    return np.concatenate([maxima, logits[:, body:]], axis=1) if body < vocab else maxima


@dataclass(frozen=True)
class _Candidates:
    """Per row, at least `width` of its largest logits (all tokens with a logit >= floor), descending."""

    descending: Floats  # [rows, max count], padded with -inf
    count: Ints  # [rows]
    floor: Floats  # [rows]; -inf when the candidates are the whole row

    def take(self, rows: Ints) -> _Candidates:
        return _Candidates(self.descending[rows], self.count[rows], self.floor[rows])

    def kth_largest(self, k: Ints) -> Floats:
        """The k-th largest logit of each row (k within the candidates), -inf where k is 0."""
        kth = self.descending[np.arange(k.size), np.maximum(k, 1) - 1]
        return np.where(k > 0, kth, np.float32(-np.inf))

    def weights(self, threshold: Floats, row_max: Floats, temperature: Doubles) -> tuple[Doubles, Doubles]:
        """exp((logit - max) / T) of the candidates at or above threshold (0 for the others and the
        padding), and their running sum, most likely first (sequential: padding never changes a row's sums)."""
        kept = (np.arange(self.descending.shape[1]) < self.count[:, None]) & (self.descending >= threshold[:, None])
        scaled = (self.descending.astype(np.float64) - row_max[:, None]) / temperature[:, None]
        e = np.where(kept, np.exp(scaled), 0.0)
        return e, np.cumsum(e, axis=1)


def _selection_floor(logits: Floats, width: int) -> Floats | None:
    """Per row, a logit that at least `width` tokens reach, and few more: the width-th largest maximum
    of the row's strided groups. None when that would not save much over taking the whole row."""
    groups = max(width * GROUPS_PER_CANDIDATE, MIN_GROUPS)
    if groups >= logits.shape[1]:
        return None
    maxima = _group_maxima(logits, groups)
    kth = maxima.shape[1] - width
    floor: Floats = np.partition(maxima, kth, axis=1)[:, kth]
    return floor


def _at_or_above(logits: Floats, floor: Floats) -> tuple[Floats, Ints, Ints]:
    """The tokens of each row with logit >= floor, padded to [rows, max count] in vocabulary order:
    their logits (padding -inf), their ids (padding 0), and how many each row has."""
    rows, vocab = logits.shape
    flat = np.flatnonzero(logits >= floor[:, None])
    row_of = flat // vocab
    count = np.bincount(row_of, minlength=rows).astype(np.int64)
    col = np.arange(flat.size) - (np.cumsum(count) - count)[row_of]
    values = np.full((rows, int(count.max())), -np.inf, dtype=np.float32)
    values[row_of, col] = logits.ravel()[flat]
    ids = np.zeros(values.shape, dtype=np.int64)
    ids[row_of, col] = flat - row_of * vocab
    return values, ids, count


def _top_candidates(logits: Floats, width: int) -> _Candidates:
    """At least `width` of each row's largest logits, with every tie (the whole row when a
    selection would not save much: a full sort, the fallback)."""
    rows, vocab = logits.shape
    floor = _selection_floor(logits, width)
    if floor is None:
        return _Candidates(-np.sort(-logits, axis=1), np.full(rows, vocab, dtype=np.int64),
                           np.full(rows, -np.inf, dtype=np.float32))
    values, _, count = _at_or_above(logits, floor)
    return _Candidates(-np.sort(-values, axis=1), count, floor)


def _top_ids(logits: Floats, k: int) -> tuple[Ints, Floats]:
    """The ids and logits of each row's k largest logits, most likely first (ties in vocabulary order)."""
    floor = _selection_floor(logits, k)
    if floor is None:
        values, ids = logits, np.broadcast_to(np.arange(logits.shape[1]), logits.shape)
    else:
        values, ids, _ = _at_or_above(logits, floor)
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)


def _exp_weights(logits: Floats, row_max: Floats, threshold: Floats, temperature: Doubles) -> Floats:
    """exp((logit - max) / T) over whole rows, 0 below each row's threshold (float32: one full pass each)."""
    e = logits - row_max[:, None]
    e *= (1 / temperature).astype(np.float32)[:, None]
    np.exp(e, out=e)
    if np.isfinite(threshold).any():
        e *= logits >= threshold[:, None]
    return e


def _block_sums(e: Floats) -> Floats:
    """Sums of consecutive BLOCK-token blocks of each row, the last (partial or empty) block included."""
    rows, vocab = e.shape
    full = vocab // BLOCK
    blocks = np.lib.stride_tricks.as_strided(
        e, shape=(rows, full, BLOCK), strides=(e.strides[0], BLOCK * e.strides[1], e.strides[1]), writeable=False,
    )
    return np.concatenate([blocks.sum(axis=2), e[:, full * BLOCK:].sum(axis=1)[:, None]], axis=1)


def _mass_from(logits: Floats, row_max: Floats, threshold: Floats, temperature: Doubles) -> Doubles:
    """Per row, the sum of exp((logit - max) / T) over the tokens with logit >= threshold (a full pass)."""
    mass: Doubles = _block_sums(_exp_weights(logits, row_max, threshold, temperature)).sum(axis=1, dtype=np.float64)
    return mass


def _rows(a: Floats, rows: Ints) -> Floats:
    """a's rows (a itself, not a copy, when rows are all of them in order)."""
    return a if rows.size == a.shape[0] and np.array_equal(rows, np.arange(rows.size)) else a[rows]


def _top_p_cut(logits: Floats, cands: _Candidates, start: Floats, row_max: Floats, settings: RowSettings,
               width: int) -> Floats:
    """top_p's threshold on rows whose distribution is the tokens at or above `start` (after min_p
    and top_k): the logit of the last token of the nucleus, ties included. The candidates came from
    `width`; rows whose nucleus reaches past them retry with WIDEN times as many."""
    cut = start.copy()
    temperature, top_p = settings.temperature, settings.top_p
    e, cumulative = cands.weights(start, row_max, temperature)
    mass = cumulative[:, -1].copy()
    outside = np.flatnonzero(start < cands.floor)  # tokens at or above start that are not candidates
    if outside.size:
        mass[outside] = _mass_from(logits[outside], row_max[outside], start[outside], temperature[outside])
    todo = np.arange(start.size)
    while True:
        before = (cumulative - e) / mass[todo, None]  # mass strictly before each token, most likely first
        kept = np.count_nonzero(e > 0, axis=1)
        nucleus = np.count_nonzero((e > 0) & (before < top_p[todo, None]), axis=1)
        done = (start[todo] >= cands.floor) | (nucleus < kept)
        cut[todo[done]] = cands.descending[np.flatnonzero(done), nucleus[done] - 1]
        todo = todo[~done]
        if not todo.size:
            return cut
        width *= WIDEN
        cands = _top_candidates(logits[todo], width)
        e, cumulative = cands.weights(start[todo], row_max[todo], temperature[todo])
        inside = np.flatnonzero(start[todo] >= cands.floor)  # the candidates' own sum is exact in float64
        mass[todo[inside]] = cumulative[inside, -1]


def keep_thresholds(logits: Floats, row_max: Floats, settings: RowSettings) -> Floats:
    """Per row, the logit from which on tokens stay in the distribution after min_p, top_k and
    top_p (the kept set is {logit >= threshold}, so ties at any cut are kept)."""
    with np.errstate(divide="ignore"):  # min_p 0: log 0 = -inf, no floor
        floor = _float32_at_least(row_max + settings.temperature * np.log(settings.min_p))
    thresholds = floor.copy()
    todo = np.flatnonzero((settings.top_k > 0) | (settings.top_p < 1))
    # Each row starts at the first width that holds its top_k, so its cut never depends on other rows.
    width = np.full(todo.size, FIRST_WIDTH, dtype=np.int64)
    while np.any(grow := width < settings.top_k[todo]):
        width[grow] *= WIDEN
    for w in np.unique(width).tolist():
        rows = todo[width == w]
        sub, row_settings = _rows(logits, rows), settings.subset(rows)
        cands = _top_candidates(sub, w)
        start = np.maximum(floor[rows], cands.kth_largest(np.minimum(row_settings.top_k, logits.shape[1])))
        thresholds[rows] = start
        p = np.flatnonzero(row_settings.top_p < 1)
        if p.size:
            thresholds[rows[p]] = _top_p_cut(_rows(sub, p), cands.take(p), start[p], row_max[rows[p]],
                                             row_settings.subset(p), w)
    return thresholds


def filtered_probs(logits: Floats, seqs: SequenceOf[SamplingState]) -> Doubles:
    """The distribution each (non-greedy) row samples from, after temperature/min_p/top_k/top_p."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    settings = RowSettings.of(seqs)
    row_max = logits.max(axis=1)
    thresholds = keep_thresholds(logits, row_max, settings)
    scaled = (logits.astype(np.float64) - row_max[:, None]) / settings.temperature[:, None]
    e = np.where(logits >= thresholds[:, None], np.exp(scaled), 0.0)
    probs: Doubles = e / e.sum(axis=1, keepdims=True)
    return probs


def _pick(cumulative: Doubles, uniforms: Doubles) -> Ints:
    """Inverse CDF: per row, the first position whose cumulative mass reaches u * total, never a
    zero-mass position (u = 0 picks the first token with mass)."""
    target = np.maximum(uniforms * cumulative[:, -1], np.finfo(np.float64).tiny)
    position: Ints = np.count_nonzero(cumulative < target[:, None], axis=1).astype(np.int64)
    return position


def _sample_candidates(logits: Floats, threshold: Floats, row_max: Floats, temperature: Doubles,
                       uniforms: Doubles) -> tuple[Ints, npt.NDArray[np.bool_]]:
    """Sample rows keeping at most MAX_PADDED tokens from those tokens alone; returns the tokens
    and which rows were sampled (the others keep too many tokens for it)."""
    rows, vocab = logits.shape
    flat = np.flatnonzero(logits >= threshold[:, None])  # ascending: rows in order, vocabulary order within
    row_of = flat // vocab
    count = np.bincount(row_of, minlength=rows)
    narrow = count <= MAX_PADDED
    chosen = narrow[row_of]
    flat, row_of = flat[chosen], row_of[chosen]
    count = np.where(narrow, count, 0)
    col = np.arange(flat.size) - (np.cumsum(count) - count)[row_of]
    width = max(int(count.max()), 1)
    e = np.zeros((rows, width), dtype=np.float64)
    e[row_of, col] = np.exp((logits.ravel()[flat] - row_max[row_of].astype(np.float64)) / temperature[row_of])
    tokens = np.zeros((rows, width), dtype=np.int64)
    tokens[row_of, col] = flat - row_of * vocab
    picked = np.minimum(_pick(np.cumsum(e, axis=1), uniforms), np.maximum(count, 1) - 1)
    return tokens[np.arange(rows), picked], narrow


def _sample_full_rows(logits: Floats, threshold: Floats, row_max: Floats, temperature: Doubles,
                      uniforms: Doubles) -> Ints:
    """Inverse CDF over whole rows without a full cumulative sum: block sums find the block, then
    a cumulative sum within that block finds the token."""
    rows, vocab = logits.shape
    e = _exp_weights(logits, row_max, threshold, temperature)
    cumulative = np.cumsum(_block_sums(e), axis=1, dtype=np.float64)
    block = np.minimum(_pick(cumulative, uniforms), vocab // BLOCK)  # a block with mass (see _pick)
    index = np.arange(rows)
    before = np.where(block > 0, cumulative[index, np.maximum(block, 1) - 1], 0.0)
    columns = block[:, None] * BLOCK + np.arange(BLOCK)
    segment = np.where(columns < vocab, e[index[:, None], np.minimum(columns, vocab - 1)], 0).astype(np.float64)
    within = np.cumsum(segment, axis=1)
    target = np.maximum(uniforms * cumulative[:, -1] - before, np.finfo(np.float64).tiny)
    position = np.count_nonzero(within < target[:, None], axis=1)
    last_with_mass = BLOCK - 1 - np.argmax(segment[:, ::-1] > 0, axis=1)  # rounding may overshoot the block
    tokens: Ints = block * BLOCK + np.minimum(position, last_with_mass)
    return tokens


def sample(logits: Floats, settings: RowSettings, uniforms: Doubles) -> Ints:
    """One token per row from its filtered distribution, by inverse CDF with the row's uniform."""
    row_max = logits.max(axis=1)
    thresholds = keep_thresholds(logits, row_max, settings)
    tokens = np.empty(logits.shape[0], dtype=np.int64)
    wide = ~np.isfinite(thresholds)  # no filter: every token is kept
    filtered = np.flatnonzero(~wide)
    if filtered.size:
        t = settings.temperature[filtered]
        picked, narrow = _sample_candidates(logits[filtered], thresholds[filtered], row_max[filtered], t,
                                            uniforms[filtered])
        tokens[filtered[narrow]] = picked[narrow]
        wide[filtered[~narrow]] = True
    rest = np.flatnonzero(wide)
    if rest.size:
        tokens[rest] = _sample_full_rows(logits[rest], thresholds[rest], row_max[rest], settings.temperature[rest],
                                         uniforms[rest])
    return tokens


class Sampler:
    def __call__(self, logits: npt.ArrayLike, seqs: list[Sequence]) -> SamplerOutput:
        raw: Floats = np.ascontiguousarray(logits, dtype=np.float32)
        assert raw.shape[0] == len(seqs), (raw.shape, len(seqs))
        penalized = any(s.token_counts is not None for s in seqs)
        processed = apply_penalties(raw.copy(), seqs) if penalized else raw
        tokens = np.empty(len(seqs), dtype=np.int64)
        greedy = np.array([s.params.greedy for s in seqs], dtype=bool)
        if greedy.any():
            rows = np.flatnonzero(greedy)
            tokens[rows] = (processed if greedy.all() else processed[rows]).argmax(axis=1)
        if not greedy.all():
            rows = np.flatnonzero(~greedy)
            sampled = [seqs[i] for i in rows]
            uniforms = np.array([s.rng.random() for s in sampled], dtype=np.float64)
            tokens[rows] = sample(processed if rows.size == len(seqs) else processed[rows], RowSettings.of(sampled),
                                  uniforms)
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


def raw_logprobs(logits: Floats, tokens: Ints, ks: list[int]) -> list[tuple[float, dict[int, tuple[float, int]]]]:
    """Per row, its token's logprob under the raw model distribution, and {token: (logprob, rank)}
    for that token and the row's k most likely ones (rank 1 = most likely; ties in vocabulary order)."""
    index = np.arange(logits.shape[0])
    row_max = logits.max(axis=1)
    log_total = row_max + np.log(_block_sums(np.exp(logits - row_max[:, None])).sum(axis=1, dtype=np.float64))
    chosen = logits[index, tokens]
    ranks = np.count_nonzero(logits > chosen[:, None], axis=1) + 1
    best_ids, best_logits = _top_ids(logits, max(*ks, 1))
    results = []
    for row, k in enumerate(ks):
        total = float(log_total[row])
        result = {int(tokens[row]): (float(chosen[row]) - total, int(ranks[row]))}
        for rank, (t, value) in enumerate(zip(best_ids[row, :k].tolist(), best_logits[row, :k].tolist(),
                                              strict=True), start=1):
            result.setdefault(t, (value - total, rank))
        results.append((float(chosen[row]) - total, result))
    return results
