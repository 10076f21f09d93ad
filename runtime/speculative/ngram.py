"""The n-gram (prompt lookup) proposer: text that quotes, rewrites or edits its input repeats it.

For each sequence, the last n tokens (n from ngram_max down to ngram_min) are looked up in the
earlier tokens, prompt and output alike; the tokens that followed the latest earlier occurrence are
the proposal. The latest occurrence, not the first: when a passage is being copied, the most recent
match is the one whose continuation the output is following.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kiln.runtime.speculative.proposer import NO_PROPOSAL, Proposal, ProposalRequest, Proposer


def lookup(tokens: np.ndarray, ngram_max: int, ngram_min: int, max_tokens: int) -> tuple[int, ...]:
    """The up to max_tokens tokens after the latest earlier occurrence of tokens' last n tokens,
    for the largest n in [ngram_min, ngram_max] that has one; () if none does."""
    length = tokens.size
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length - n - 1: every earlier n-gram, never the suffix itself
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(int(t) for t in tokens[start:start + max_tokens])
    return ()


class NgramProposer(Proposer):
    def __init__(self, ngram_max: int, ngram_min: int) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        proposals = []
        for request in requests:
            tokens = np.asarray(request.seq.token_ids, dtype=np.int64)
            found = lookup(tokens, self.ngram_max, self.ngram_min, request.max_tokens)
            proposals.append(Proposal(found) if found else NO_PROPOSAL)
        return proposals
