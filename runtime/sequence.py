"""Sequence: one stream of tokens being generated, and the state the scheduler keeps for it."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kiln.runtime.params import SamplingParams
from kiln.runtime.vision.prompt import ImageSpan, block_image_keys

if TYPE_CHECKING:
    from kiln.runtime.structured.grammar import GrammarState

_ids = itertools.count()


class TokenCounts:
    """The distinct tokens of a sequence's prompt and output, each with how often it occurs in the
    output: what the repetition, frequency and presence penalties read. Kept up to date one token
    at a time, so a step's penalties never copy the token lists."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        distinct = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
        self._slot: dict[int, int] = {int(t): i for i, t in enumerate(distinct.tolist())}
        capacity = max(16, 2 * distinct.size)
        self._ids = np.zeros(capacity, dtype=np.int64)
        self._ids[: distinct.size] = distinct
        self._counts = np.zeros(capacity, dtype=np.float32)

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def ids(self) -> npt.NDArray[np.int64]:
        """The distinct token ids seen (prompt or output), in order of first appearance after the prompt's."""
        return self._ids[: len(self._slot)]

    @property
    def counts(self) -> npt.NDArray[np.float32]:
        """Output occurrences of each id in `ids` (0 for a prompt-only token)."""
        return self._counts[: len(self._slot)]

    def copy(self) -> TokenCounts:
        """An independent tally (speculative verification counts tokens it may still reject)."""
        twin = TokenCounts.__new__(TokenCounts)
        twin._slot, twin._ids, twin._counts = dict(self._slot), self._ids.copy(), self._counts.copy()
        return twin

    def add(self, token_id: int) -> None:
        """Count one output token."""
        slot = self._slot.get(token_id)
        if slot is None:
            slot = len(self._slot)
            if slot == self._ids.size:  # double the buffers: amortised O(1) per token
                self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._slot[token_id] = slot
            self._ids[slot] = token_id
        self._counts[slot] += 1


def _penalized(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.frequency_penalty != 0 or params.presence_penalty != 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding blocks (new, or preempted)
    RUNNING = "running"  # holding blocks; catching up (prefill) or decoding
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt + output), how many of them have K/V in the cache, and the block table.

    A sequence is never in a "prefill" or "decode" phase: it has len(token_ids) tokens, of
    which num_computed_tokens have K/V in its blocks, and each step computes some of the rest.
    Writers: the engine appends tokens (which also keeps token_counts, for requests with
    penalties), the scheduler owns num_computed_tokens and status, the block manager owns
    block_table and block_hashes.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival: float = 0.0,
        rng: np.random.Generator | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None:
        self.seq_id = next(_ids)
        self.index = index  # sample index within its request (n > 1)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full, computed blocks
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        if rng is None:  # a seeded request's sample i draws from its own stream, whatever the batch
            rng = np.random.default_rng(None if params.seed is None else [params.seed, index])
        self.rng = rng
        self.token_counts = TokenCounts(prompt_token_ids) if _penalized(params) else None
        self.grammar: GrammarState | None = None  # the matcher of a structured request (params.structured)
        self.images = images  # the prompt's image runs and their embeddings (vision-language engines)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, {self.status.value})"
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_key(self, index: int, block_size: int) -> tuple[tuple[int, int], ...]:
        """What block `index` hashes besides its token ids: the images it holds (empty for text)."""
        return block_image_keys(self.images, index * block_size, block_size) if self.images else ()

    def whole_image_runs(self, num_new: int) -> int:
        """num_new cut back so that a chunk of it does not end inside a bidirectional image run (Gemma 3's: its
        tokens see each other, so they are computed in one step); 0 when the chunk cannot reach the run's end."""
        end = self.num_computed_tokens + num_new
        for span in self.images:
            if span.bidirectional and span.start < end < span.end:
                return max(0, span.start - self.num_computed_tokens)
        return num_new

    @property
    def images_pending(self) -> bool:
        """Whether image positions remain to be computed (a step then packs their embeddings)."""
        return bool(self.images) and self.num_computed_tokens < self.images[-1].end

    def append(self, token_id: int) -> None:
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if self.token_counts is not None:
            self.token_counts.add(token_id)

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
