"""Scheduler: which sequences compute how many tokens in the next step.

There is no prefill phase and no decode phase: every sequence is catching up with its own
token list. Each step has a token budget (max_num_tokens) and a sequence budget
(max_num_seqs). Running sequences one token behind (decodes) go first, then running
sequences further behind (prefill chunks, resumed sequences), then waiting ones in arrival
order (FCFS). A long prompt is split into chunks that fit the remaining budget, so it never
stalls decodes. When a running sequence cannot get a block for even one more token, the
most recently arrived running sequence is preempted: its blocks are freed and it goes back
to the front of the waiting queue, to be recomputed (cheaply, from the prefix cache, where
its blocks survived) and resumed with the same tokens.

The scheduler is the one writer of a sequence's num_computed_tokens: the block manager
returns what it found or shared (prefix-cache hits, forked blocks) and the scheduler records it.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kiln.runtime.block_manager import RELEASED, BlockManager
from kiln.runtime.sequence import Sequence, SequenceStatus

_NO_ROWS = np.zeros(0, np.int64)
_NO_ROWS.flags.writeable = False


@dataclass(frozen=True)
class LogitsRows:
    """Where each sampling sequence's rows sit in a step's logits, laid out once per step
    (SchedulerOutput.logits_rows) and read by everyone who needs it: the batch (logits_indices,
    medusa_indices), the sampler and verification (each sequence's rows), and the Medusa heads.

    Sequences that sample follow each other in row order (SchedulerOutput.to_sample). One with k
    proposals has k + 1 rows, the last k + 1 tokens of its run (row j follows its tokens and its first
    j proposals); any other has one, its last token's."""

    token_indices: np.ndarray  # int64 [L]: the packed-batch token of each logits row
    starts: tuple[int, ...]  # per sampling sequence, its first logits row
    counts: tuple[int, ...]  # per sampling sequence, its number of rows (k + 1)
    heads: np.ndarray  # int64 [M]: the logits rows the Medusa heads are computed at, ascending

    @property
    def num_rows(self) -> int:
        return int(self.token_indices.size)

    @staticmethod
    def of(out: SchedulerOutput) -> LogitsRows:
        if out.is_decode_only:  # a row each, in order: the common step, without the arithmetic
            rows = np.arange(len(out.scheduled), dtype=np.int64)
            starts, counts = tuple(range(len(rows))), (1,) * len(rows)
        else:
            need = np.array(out.needs_logits, dtype=bool)
            tokens = np.array([n + len(out.proposals_of(r)) for r, (_, n) in enumerate(out.scheduled)], np.int64)
            ends = np.cumsum(tokens)[need]
            widths = np.array([len(p) + 1 for p in out.proposals], np.int64)[need] if out.proposals \
                else np.ones(int(need.sum()), np.int64)
            first_rows = np.cumsum(widths) - widths
            # the last widths[i] tokens of each sequence that samples
            rows = np.repeat(ends - widths - first_rows, widths) + np.arange(int(widths.sum()), dtype=np.int64)
            starts, counts = tuple(first_rows.tolist()), tuple(widths.tolist())
        if not out.medusa_rows:
            return LogitsRows(rows, starts, counts, _NO_ROWS)
        wanted = [m for m, need in zip(out.medusa_rows, out.needs_logits, strict=True) if need]
        heads = np.concatenate([np.arange(start, start + m, dtype=np.int64)
                                for start, m in zip(starts, wanted, strict=True)]) if any(wanted) else _NO_ROWS
        return LogitsRows(rows, starts, counts, heads)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: the scheduled sequences with how many new tokens each computes (from its
    num_computed_tokens on), and which of them reach their last token and so need logits and
    a sampled token. Decided once here; the batch builder and the engine's postprocess read it,
    the logits rows through logits_rows."""

    scheduled: tuple[tuple[Sequence, int], ...] = ()
    needs_logits: tuple[bool, ...] = ()  # per scheduled row
    preempted: tuple[Sequence, ...] = ()
    # Per scheduled row, speculative tokens checked after its own (empty: none; () for all: no speculation).
    # A row with k proposals computes n + k tokens and needs logits for its last k + 1.
    proposals: tuple[tuple[int, ...], ...] = ()
    # Per scheduled row, at how many of its logits rows (from the first) the Medusa heads are computed
    # (() for all: at none).
    medusa_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.needs_logits) != len(self.scheduled):
            raise ValueError(f"needs_logits has {len(self.needs_logits)} entries for {len(self.scheduled)} "
                             "scheduled sequences")
        if self.proposals and len(self.proposals) != len(self.scheduled):
            raise ValueError(f"proposals has {len(self.proposals)} entries for {len(self.scheduled)} "
                             "scheduled sequences")
        if self.medusa_rows:
            if len(self.medusa_rows) != len(self.scheduled):
                raise ValueError(f"medusa_rows has {len(self.medusa_rows)} entries for {len(self.scheduled)} "
                                 "scheduled sequences")
            for r, (m, need) in enumerate(zip(self.medusa_rows, self.needs_logits, strict=True)):
                if not 0 <= m <= (len(self.proposals_of(r)) + 1 if need else 0):
                    raise ValueError(f"medusa_rows[{r}] is {m}, outside the row's logits rows")

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled) + sum(len(p) for p in self.proposals)

    def proposals_of(self, row: int) -> tuple[int, ...]:
        return self.proposals[row] if self.proposals else ()

    @cached_property
    def is_decode_only(self) -> bool:
        """Every scheduled sequence computes one token and samples after it (no proposals)."""
        return not self.proposals and all(n == 1 for _, n in self.scheduled) and all(self.needs_logits)

    @cached_property
    def logits_rows(self) -> LogitsRows:
        return LogitsRows.of(self)

    @property
    def to_sample(self) -> list[Sequence]:
        """The sequences that sample a token after this step, in row (logits) order."""
        return [seq for (seq, _), need in zip(self.scheduled, self.needs_logits, strict=True) if need]

    def __bool__(self) -> bool:
        return bool(self.scheduled)


def _priority(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival, seq.seq_id)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by priority (arrival order)
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_forked(self, parent: Sequence, child: Sequence) -> None:
        """Start child (another sample of parent's prompt) on parent's computed blocks."""
        child.num_computed_tokens = self.bm.fork(parent, child)
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=_priority)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Finish (or abort) a sequence wherever it is, freeing its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish(reason, stop_reason)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        if self.bm.sliding_window:
            for seq in self.running:  # blocks behind every window give room to this step's chunks
                self.bm.release_outside_window(seq)
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        catching_up = [s for s in self.running if s.num_uncomputed > 1]
        budget = self.max_num_tokens
        for seq in decodes + catching_up:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            want = seq.whole_image_runs(min(seq.num_uncomputed, budget))
            if not want:  # the budget left ends inside an image run: the whole run waits for a later step
                continue
            num_new = self._fit_running(seq, want, scheduled, preempted)
            if num_new:
                scheduled[seq] = num_new
            budget = self.max_num_tokens - sum(scheduled.values()) if preempted else budget - num_new
        budget = self.max_num_tokens - sum(scheduled.values())
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget)
            if not num_new:
                break  # FCFS: nothing behind it goes first; retry when blocks free up
            scheduled[seq] = num_new
            budget -= num_new
        rows = tuple(scheduled.items())
        needs_logits = tuple(seq.num_computed_tokens + n == len(seq) for seq, n in rows)
        return SchedulerOutput(rows, needs_logits, tuple(preempted))

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Start the first waiting seq on its cached prefix plus a chunk of up to `budget` new
        tokens; returns the chunk's length, or 0 (seq left waiting, no blocks held) if it can't get blocks."""
        cached = self.bm.match_prefix(seq)
        seq.num_computed_tokens = cached  # (allocate releases the cached blocks behind the chunk's window)
        num_new = seq.whole_image_runs(min(len(seq) - cached, budget))
        if not num_new or not self.bm.allocate(seq, cached + num_new):
            self._release(seq)  # give back the prefix hits
            return 0
        self.waiting.popleft()
        self.prefix_cache_queries += len(seq)
        self.prefix_cache_hits += cached
        if seq.num_output_tokens == 0 and seq.num_cached_tokens == 0:
            seq.num_cached_tokens = cached
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_priority)
        return num_new

    def admit_computed(self, seq: Sequence, num_computed: int,
                       write: Callable[[list[int], list[int]], None]) -> bool:
        """Start seq running with its first num_computed tokens' K/V computed elsewhere (a KV handoff):
        it shares the blocks the prefix cache holds, gets blocks for the rest and ``write(block_ids,
        indices)`` fills those (indices: their places in seq's block table), then the full ones are hashed.
        False, and nothing held, when max_num_seqs or the free blocks leave no room now."""
        if len(self.running) >= self.max_num_seqs:
            return False
        cached = self.bm.match_prefix(seq)
        seq.num_computed_tokens = num_computed  # allocate leaves what is behind the sliding window blockless
        if not self.bm.allocate(seq, num_computed):
            self._release(seq)
            return False
        table = seq.block_table
        indices = [i for i in range(cached // self.bm.block_size, len(table)) if table[i] != RELEASED]
        write([table[i] for i in indices], indices)
        self.bm.commit(seq)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_priority)
        return True

    def _fit_running(self, seq: Sequence, want: int, scheduled: dict[Sequence, int],
                     preempted: list[Sequence]) -> int:
        """Blocks for up to `want` more tokens of a running seq; preempts others if none fit."""
        while True:
            fit = seq.whole_image_runs(self.bm.can_fit(seq, want))
            if fit > 0:
                allocated = self.bm.allocate(seq, seq.num_computed_tokens + fit)
                assert allocated
                return fit
            victim = self.running[-1]
            scheduled.pop(victim, None)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0  # its K/V went with the blocks

    def add_proposals(self, out: SchedulerOutput, proposals: dict[Sequence, tuple[int, ...]]) -> SchedulerOutput:
        """out with speculative tokens after the decodes in `proposals`, each cut to what the step's
        token budget and the free blocks allow. Speculation never preempts: a proposal that finds no
        free block is dropped (or shortened), the decode itself is already placed."""
        budget = self.max_num_tokens - out.num_tokens
        rows = []
        for (seq, num_new), need in zip(out.scheduled, out.needs_logits, strict=True):
            proposal = proposals.get(seq, ()) if need and budget > 0 else ()
            if proposal:
                fit = self.bm.can_fit(seq, num_new + min(len(proposal), budget)) - num_new
                proposal = proposal[:max(fit, 0)]
            if proposal:
                allocated = self.bm.allocate(seq, seq.num_computed_tokens + num_new + len(proposal))
                assert allocated
                budget -= len(proposal)
            rows.append(proposal)
        return SchedulerOutput(out.scheduled, out.needs_logits, out.preempted, tuple(rows), out.medusa_rows)

    def settle(self, seq: Sequence, num_accepted: int) -> None:
        """After verification (the engine has appended the accepted tokens and the bonus token): the
        accepted proposals' K/V count as computed; the rejected ones' blocks are freed, and the blocks
        the accepted ones filled are hashed."""
        seq.num_computed_tokens += num_accepted
        self.bm.truncate(seq, seq.num_computed_tokens)
        self.bm.commit(seq)

    # -- after the model ran ----------------------------------------------------------------

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after a step and hash the blocks it filled."""
        for seq, num_new in out.scheduled:
            start = seq.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(start + num_new, seq.num_prompt_tokens) - start)
            seq.num_computed_tokens = start + num_new
            self.bm.commit(seq)
