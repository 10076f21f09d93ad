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
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The sequences of one step and how many new tokens each computes (from num_computed_tokens)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

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
        self.bm.fork(parent, child)
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
        self.bm.free(seq)
        seq.finish(reason, stop_reason)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_tokens
        scheduled: dict[Sequence, int] = {}
        out = SchedulerOutput()
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        catching_up = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + catching_up:
            budget = self.max_num_tokens - sum(scheduled.values())
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = self._fit_running(seq, min(seq.num_uncomputed, budget), scheduled, out)
            if num_new:
                scheduled[seq] = num_new
        budget = self.max_num_tokens - sum(scheduled.values())
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            cached = self.bm.match_prefix(seq)
            num_new = min(seq.num_uncomputed, budget)
            if not self.bm.allocate(seq, seq.num_computed_tokens + num_new):
                self.bm.free(seq)  # give back the prefix hits; retry when blocks free up
                break
            self.waiting.popleft()
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += cached
            if seq.num_output_tokens == 0 and seq.num_cached_tokens == 0:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_priority)
            scheduled[seq] = num_new
            budget -= num_new
        out.scheduled = list(scheduled.items())
        return out

    def _fit_running(self, seq: Sequence, want: int, scheduled: dict[Sequence, int], out: SchedulerOutput) -> int:
        """Blocks for up to `want` more tokens of a running seq; preempts others if none fit."""
        while True:
            fit = self.bm.can_fit(seq, want)
            if fit > 0:
                allocated = self.bm.allocate(seq, seq.num_computed_tokens + fit)
                assert allocated
                return fit
            victim = self.running[-1]
            scheduled.pop(victim, None)
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    # -- after the model ran ----------------------------------------------------------------

    def update(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance computed counts after a step; returns the sequences that need a sampled token."""
        need_token = []
        for seq, num_new in out.scheduled:
            start = seq.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(start + num_new, seq.num_prompt_tokens) - start)
            seq.num_computed_tokens = start + num_new
            self.bm.commit(seq)
            if seq.num_computed_tokens == len(seq):
                need_token.append(seq)
        return need_token
