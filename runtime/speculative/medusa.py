"""The Medusa proposer: heads compiled into the target engine guess the tokens after the latest one.

Head i, read at the row whose logits chose a sequence's latest token, guesses the token i places after
it (kiln/medusa.py). The engine asks the graph for the heads' logits at the verified rows of each
sequence (`medusa_indices`), and after the step hands the proposer, per sequence, the heads' logits of
the row that chose its latest token (`observe`); the next step proposes the heads' top-1 chain.

Guesses are kept with the sequence's length when they were made: they follow exactly that prefix, so a
sequence whose latest token came from a row without heads (a plain step, or a fork) gets no proposal
until a step reads its heads again. Preemption recomputes the same tokens, so kept guesses stay valid.
Proposals are deterministic (one-hot, like ngram's): rejection sampling keeps sampled output exact.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative.proposer import NO_PROPOSAL, Proposal, ProposalRequest, Proposer


class KeptGuesses(Proposer):
    """A proposer whose guesses are made after a step (observe) and proposed at the next: kept per sequence
    with its length then, and proposed only while the sequence still has that length."""

    def __init__(self, min_probability: float = 0.0) -> None:
        """min_probability: SpeculativeConfig's min_guess_probability (keep_confident)."""
        self.guesses: dict[int, tuple[int, tuple[int, ...]]] = {}  # seq_id -> (its length then, the K guesses)
        self.min_probability = min_probability

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        out = []
        for request in requests:
            kept = self.guesses.get(request.seq.seq_id)
            if kept is None or kept[0] != len(request.seq):
                out.append(NO_PROPOSAL)
            else:
                out.append(Proposal(kept[1][:request.max_tokens]))
        return out

    def keep(self, seqs: list[Sequence], guesses: list[list[int]]) -> None:
        for seq, row in zip(seqs, guesses, strict=True):
            self.guesses[seq.seq_id] = (len(seq), tuple(row))

    def keep_confident(self, seqs: list[Sequence], guesses: np.ndarray, probabilities: np.ndarray | None) -> None:
        """Keep each sequence's guesses [K] as far as the running product of their probabilities [K] (each
        head's own, of its guess) stays >= min_probability; all of them when probabilities is None."""
        if probabilities is None or not self.min_probability:
            self.keep(seqs, guesses.tolist())
            return
        lengths = (np.cumprod(probabilities, axis=1) >= self.min_probability).sum(1)  # a product only falls: a prefix
        self.keep(seqs, [row[:n] for row, n in zip(guesses.tolist(), lengths.tolist(), strict=True)])

    def release(self, seq: Sequence) -> None:
        self.guesses.pop(seq.seq_id, None)


class MedusaProposer(KeptGuesses):
    def __init__(self, num_heads: int, max_rows: int | None = 1, min_probability: float = 0.0) -> None:
        """max_rows: compute the heads at no more than this many of a sequence's verified rows (from the
        first); None: at all of them. Default 1: each row read adds K rows to the LM head, and with SmolLM2's
        heads the first row alone measured faster at every k on fp32 and int4-q4_1 (docs/design.md, "Medusa
        heads": 1.12x vs 1.01x at k=1 on fp32); heads right most of the time would pay for every row."""
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
        super().__init__(min_probability)
        self.num_heads = num_heads
        self.max_rows = max_rows

    def medusa_rows(self, width: int) -> int:
        return width if self.max_rows is None else min(width, self.max_rows)

    def observe(self, seqs: list[Sequence], rows: list[int], extras: Mapping[str, np.ndarray]) -> None:
        heads = extras["medusa_logits"]  # [rows, K, V]
        if not seqs:
            return
        logits = heads[rows]  # [len(seqs), K, V]
        probabilities = None
        if self.min_probability:  # of each head's top token: 1 / sum(exp(logits - max))
            probabilities = 1.0 / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)
        self.keep_confident(seqs, logits.argmax(axis=-1), probabilities)
