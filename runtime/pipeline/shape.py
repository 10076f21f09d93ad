"""PipelineShape: what the Engine reads off a pipeline's runner, as its last stage's graph gives it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineShape:
    num_blocks: int  # blocks in each layer's pool (every stage has the same: one BlockManager places them)
    vocab_size: int
    num_medusa_heads: int = 0
    medusa_output: str | None = None  # contract.MEDUSA_LOGITS or MEDUSA_HIDDEN where the engine has heads
