"""TensorParallelRunner: a ModelRunner whose steps run on every rank of a RankGroup.

One BlockManager places blocks for all ranks: each rank has pools of the same num_blocks for every layer (its own
KV heads), so a block id means the same slot in every rank's pools.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from kiln import contract
from kiln.contract import KvPoolSpec
from kiln.manifest import EngineLoadError, Manifest
from kiln.runtime.model_runner import BatchInput, ModelRunner, RunnerOutput
from kiln.runtime.outputs import RankTotals
from kiln.runtime.tensor_parallel.group import GroupSizing, RankGroup
from kiln.tensor_parallel import TensorRank


def rank_pools(pools: KvPoolSpec, ranks: tuple[TensorRank, ...]) -> list[KvPoolSpec]:
    """Each rank's pool layout: the engine's, with the rank's KV heads."""
    return [dataclasses.replace(pools, num_kv_heads=len(rank.kv_heads)) for rank in ranks]


def group_bytes_per_block(pools: KvPoolSpec, ranks: tuple[TensorRank, ...]) -> int:
    """One block's bytes summed over the ranks' pools (a KV head held by two ranks counts twice)."""
    return sum(p.bytes_per_block for p in rank_pools(pools, ranks))


class TensorParallelRunner(ModelRunner):
    """Runs each step on every rank; rank 0 returns the logits."""

    def __init__(self, group: RankGroup, pools: KvPoolSpec, num_blocks: int) -> None:
        self.group, self.pool_spec = group, pools
        self.num_blocks, self.block_size, self.vocab_size = num_blocks, pools.block_size, group.vocab_size
        self.rank_seconds = [0.0] * len(group.sizing.ranks)
        self.steps = 0

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * group_bytes_per_block(self.pool_spec, self.group.sizing.ranks)

    def execute(self, batch: BatchInput) -> np.ndarray:
        return self.execute_all(batch).logits

    def execute_all(self, batch: BatchInput) -> RunnerOutput:
        if batch.medusa_indices is not None and len(batch.medusa_indices):
            raise ValueError("a tensor-parallel engine has no Medusa heads; leave medusa_indices unset")
        if batch.image_rows is not None and len(batch.image_rows):
            raise ValueError("a tensor-parallel engine takes no image embeddings")
        try:
            reply = self.group.step(batch)
        finally:
            for rank, seconds in enumerate(self.group.seconds):
                self.rank_seconds[rank] += seconds
            self.steps += 1
        assert reply.logits is not None  # rank 0's graph outputs them
        return RunnerOutput(reply.logits)

    def rank_totals(self) -> RankTotals:
        stats = self.group.rank_stats()
        return RankTotals(tuple(self.rank_seconds), tuple(s["wait_ns"] / 1e9 for s in stats),
                          sum(s["bytes"] for s in stats), self.steps, self.group.restarts)

    def close(self) -> None:
        self.group.close()


def open_tensor_parallel_runner(engine_dir: Path, manifest: Manifest, pools: KvPoolSpec, num_blocks: int,
                                num_threads: int, max_tokens: int) -> TensorParallelRunner:
    """The engine's ranks in their processes, num_threads ORT threads each."""
    sizing = GroupSizing(Path(engine_dir), manifest.ranks, pools, num_blocks, num_threads, max_tokens,
                         manifest.spec.hidden_size)
    group = RankGroup(sizing)
    if group.vocab_size < 1:
        group.close()
        raise EngineLoadError(f"{engine_dir}'s rank 0 graph has no static {contract.LOGITS} width; rebuild the engine")
    return TensorParallelRunner(group, pools, num_blocks)
