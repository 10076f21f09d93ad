"""An engine's side of disaggregated prefill and decode (runtime/cluster/): handing a prompt's KV out with
its first token, and starting requests that arrive with theirs (kv_transfer.KvHandoff)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np

from kiln.runtime.block_manager import RELEASED, BlockManager
from kiln.runtime.kv_transfer import KvHandoff
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.sampler import SamplerOutput
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence


class HandoffQueue:
    """Sequences that arrived with their prompt's KV, waiting in arrival order for blocks of this engine's
    pools."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self._waiting: deque[tuple[Sequence, KvHandoff]] = deque()

    def add(self, seq: Sequence, kv: KvHandoff) -> None:
        self._waiting.append((seq, kv))

    def discard(self, seq: Sequence) -> None:
        self._waiting = deque(item for item in self._waiting if item[0] is not seq)

    def admit(self) -> Iterator[tuple[Sequence, SamplerOutput]]:
        """Start waiting sequences, in arrival order, while blocks allow: each one's KV is written into the
        pools and its first token is yielded as sampled here, for the caller to append before the next one
        is tried (appending may fork or finish it, which takes or frees blocks)."""
        while self._waiting:
            seq, kv = self._waiting[0]
            write = lambda ids, idx, kv=kv: self.runner.write_kv_blocks(ids, kv.blocks[:, idx])  # noqa: E731
            if not self.scheduler.admit_computed(seq, len(seq), write):
                return
            self._waiting.popleft()
            seq.num_cached_tokens = kv.num_cached_tokens
            yield seq, SamplerOutput(np.array([kv.first_token]), [kv.first_logprob], [kv.first_top_logprobs])


def export_handoff(seq: Sequence, sampled: SamplerOutput, row: int, block_manager: BlockManager,
                   runner: ModelRunner) -> KvHandoff:
    """seq's prompt KV and its first token (sampled's `row`), read before a stop could free the blocks.
    Blocks released behind a sliding window go as zeros: no token to come reads them, and the receiver,
    releasing the same ones, writes none of them."""
    table = seq.block_table[: block_manager.blocks_needed(seq.num_prompt_tokens)]
    held = [i for i, block_id in enumerate(table) if block_id != RELEASED]
    kv = runner.read_kv_blocks([table[i] for i in held])
    if len(held) < len(table):
        full = np.zeros((kv.shape[0], len(table), *kv.shape[2:]), kv.dtype)
        full[:, held] = kv
        kv = full
    return KvHandoff(tuple(seq.token_ids[: seq.num_prompt_tokens]), int(sampled.token_ids[row]),
                     sampled.sampled_logprobs[row], sampled.top_logprobs[row], seq.num_cached_tokens, kv)
