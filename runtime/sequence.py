"""Sequence: one stream of tokens being generated, and the state the scheduler keeps for it."""

from __future__ import annotations

import enum
import itertools

import numpy as np

from kiln.runtime.params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding blocks (new, or preempted)
    RUNNING = "running"  # holding blocks; catching up (prefill) or decoding
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt + output), how many of them have K/V in the cache, and the block table.

    A sequence is never in a "prefill" or "decode" phase: it has len(token_ids) tokens, of
    which num_computed_tokens have K/V in its blocks, and each step computes some of the rest.
    Writers: the engine appends tokens, the scheduler owns num_computed_tokens and status,
    the block manager owns block_table and block_hashes.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival: float = 0.0,
        rng: np.random.Generator | None = None,
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

    def append(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
