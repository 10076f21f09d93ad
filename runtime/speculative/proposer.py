"""The proposer interface of speculative decoding: guesses of the next tokens, checked by the target.

A proposer sees each sequence before a step (`propose`) and, after the step, the target's extra graph
outputs at the row that chose each sequence's latest token (`observe`): that is the hook a proposer fed
by the target's own state reads (a proposer whose `medusa_rows` is positive makes the engine ask the graph
for the Medusa heads' logits; head i on that row's hidden state guesses the token i places after the
latest); n-gram and draft proposers ignore it. `release` drops whatever a proposer keeps for a finished
sequence.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kiln.runtime.sequence import Sequence


@dataclass(frozen=True)
class ProposalRequest:
    """Propose at most max_tokens tokens to follow seq's token_ids."""

    seq: Sequence
    max_tokens: int


@dataclass(frozen=True)
class Proposal:
    """Guessed tokens, and the distribution each was drawn from ([len, vocab] float64), or None for a
    deterministic proposer (each token's distribution is one-hot on it), as rejection sampling needs."""

    token_ids: tuple[int, ...] = ()
    probs: npt.NDArray[np.float64] | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError(f"probs has {self.probs.shape[0]} rows for {len(self.token_ids)} proposed tokens")

    def head(self, n: int) -> Proposal:
        """The first n proposed tokens."""
        if n == len(self.token_ids):
            return self
        return Proposal(self.token_ids[:n], None if self.probs is None else self.probs[:n])


NO_PROPOSAL = Proposal()


class Proposer(abc.ABC):
    @abc.abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request (NO_PROPOSAL where it has no guess), each within its max_tokens."""

    def medusa_rows(self, width: int) -> int:
        """How many of a sequence's `width` logits rows (its verified rows, or its one row) this step the
        Medusa heads should be computed at, from the first on; 0 (the default): the proposer reads none."""
        return 0

    def observe(self, seqs: list[Sequence], rows: list[int], extras: Mapping[str, np.ndarray]) -> None:  # noqa: B027
        """After a step: for each sequence that got tokens and goes on and whose deciding row has extra
        outputs, `rows[i]` is that row in `extras` (the graph outputs beside the logits: "medusa_logits"
        [rows, K, V], or for hydra heads "medusa_hidden" [rows, D]): the row whose logits chose seqs[i]'s
        latest token (a verified row: the first rejected or the bonus one). Optional."""

    def release(self, seq: Sequence) -> None:  # noqa: B027 - optional
        """seq finished or was aborted: drop what is kept for it."""

    def close(self) -> None:  # noqa: B027 - optional
        pass
