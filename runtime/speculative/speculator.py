"""Speculator: speculative decoding as one engine step sees it.

Before the step, `plan` gives the step's decodes their proposals (the proposer's guesses, cut to what the
token budget and the free blocks allow: Scheduler.add_proposals) and says at which of each sequence's logits
rows the Medusa heads are computed; where those rows sit is SchedulerOutput.logits_rows. After the step,
`verify` checks a sequence's proposals against its k + 1 rows, and `observe` hands the proposer the heads'
outputs at the row that chose each sequence's latest token.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kiln.runtime.params import SpeculativeConfig
from kiln.runtime.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative.proposer import Proposal, ProposalRequest, Proposer
from kiln.runtime.speculative.verify import SpecStats, Verdict, verify
from kiln.runtime.structured.grammar import MaskStep


class Speculator:
    def __init__(self, proposer: Proposer, config: SpeculativeConfig, scheduler: Scheduler, max_seq_len: int,
                 masks: MaskStep) -> None:
        """max_seq_len: the engine's (a sequence's proposals never take it past that); masks: the engine's
        structured-output masks (a constrained sequence's rows are verified under its grammar)."""
        self.proposer = proposer
        self.masks = masks
        self.config = config
        self.scheduler = scheduler
        self.max_seq_len = max_seq_len
        self.stats = SpecStats()
        self._proposals: dict[Sequence, Proposal] = {}  # this step's, by sequence

    @property
    def max_step_tokens(self) -> int:
        """Past this many tokens a step does not speculate: checking guesses costs more than it saves
        (docs/design.md)."""
        return min(self.config.max_batch_tokens, self.scheduler.max_num_tokens)

    def plan(self, out: SchedulerOutput) -> SchedulerOutput:
        """out with its decodes' proposals and the logits rows the Medusa heads are computed at."""
        return self._with_heads(self._propose(out))

    def _propose(self, out: SchedulerOutput) -> SchedulerOutput:
        """Proposals for the step's decodes, while the step stays within max_step_tokens, shared evenly among
        them."""
        decodes = [seq for (seq, n), need in zip(out.scheduled, out.needs_logits, strict=True)
                   if need and n == 1 and seq.num_output_tokens > 0]
        room = self.max_step_tokens - out.num_tokens
        share = min(self.config.num_tokens, room // len(decodes)) if decodes else 0
        if share < 1:
            return out
        requests = []
        for seq in decodes:
            # k proposals emit up to k + 1 tokens: stay within max_tokens and max_seq_len
            left = self.max_seq_len - len(seq)
            if seq.params.max_tokens is not None:
                left = min(left, seq.params.max_tokens - seq.num_output_tokens)
            if left > 1:
                requests.append(ProposalRequest(seq, min(share, left - 1)))
        if not requests:
            return out
        proposed = {r.seq: p for r, p in zip(requests, self.proposer.propose(requests), strict=True) if p.token_ids}
        out = self.scheduler.add_proposals(out, {seq: p.token_ids for seq, p in proposed.items()})
        # what the budget and the free blocks let through
        self._proposals = {seq: proposed[seq].head(len(granted))
                           for (seq, _), granted in zip(out.scheduled, out.proposals, strict=True) if granted}
        return out

    def _with_heads(self, out: SchedulerOutput) -> SchedulerOutput:
        """out with medusa_rows: the proposer says at how many of each sequence's rows (the accepted length
        is known only afterwards); none when it reads no heads or the next step could not speculate anyway
        (as many sequences sample as _propose switches off at)."""
        wanted = [self.proposer.medusa_rows(len(out.proposals_of(r)) + 1) if need else 0
                  for r, need in enumerate(out.needs_logits)]
        num_sampling = sum(out.needs_logits)
        if not any(wanted) or self.max_step_tokens - num_sampling < num_sampling:
            return out
        return SchedulerOutput(out.scheduled, out.needs_logits, out.preempted, out.proposals, tuple(wanted))

    def verify(self, seq: Sequence, logits: np.ndarray) -> Verdict:
        """Which of seq's proposals to keep, given its k + 1 rows of logits; recorded in stats. A structured
        sequence's rows are masked by its grammar first (row j: after the first j proposals), so a proposal the
        grammar refuses is rejected and every kept or added token follows it; the matcher then advances over
        what was kept (GrammarState.sync), never over what was rejected."""
        proposal = self._proposals.pop(seq)
        if seq.grammar is not None:
            seq.grammar.sync(seq.token_ids, seq.num_prompt_tokens)
            logits = np.array(logits, dtype=np.float32)  # a copy: the step's rows stay raw for logprobs
            self.masks.apply_speculated(logits, seq.grammar, proposal.token_ids)
        verdict = verify(seq, logits, proposal)
        self.stats.record(len(proposal.token_ids), verdict.num_accepted)
        return verdict

    def observe(self, out: SchedulerOutput, latest_rows: list[int], extras: Mapping[str, np.ndarray]) -> None:
        """After the step: latest_rows[i], the logits row that chose out.to_sample[i]'s latest token. The
        proposer gets the heads' outputs (extras) at that row, for each sequence that goes on and has them."""
        heads = out.logits_rows.heads
        if not heads.size or not extras:
            return
        where = {int(row): m for m, row in enumerate(heads)}  # logits row -> its row of the heads' outputs
        seqs = out.to_sample
        live = [i for i, seq in enumerate(seqs) if not seq.is_finished and latest_rows[i] in where]
        self.proposer.observe([seqs[i] for i in live], [where[latest_rows[i]] for i in live], extras)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
