"""PipelineShape (what the Engine reads off a pipeline's runner) and StageSizing (how its stages open)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.contract import KvPoolSpec


@dataclass(frozen=True)
class PipelineShape:
    num_blocks: int  # blocks in each layer's pool (every stage has the same: one BlockManager places them)
    vocab_size: int
    num_medusa_heads: int = 0
    medusa_output: str | None = None  # contract.MEDUSA_LOGITS or MEDUSA_HIDDEN where the engine has heads


@dataclass(frozen=True)
class StageSizing:
    """How every stage of one pipeline is opened: the engine's pool layout, blocks per layer pool, threads, and
    (stages in their own processes) the memory each may take beyond its process's own (memory.limit_memory_growth)."""

    pools: KvPoolSpec
    num_blocks: int
    num_threads: int | None  # per stage; None: onnxruntime's default
    memory_budget_bytes: int | None = None  # None: no cap
