"""PipelineRunner: an engine's stages behind the one ModelRunner interface the Engine drives.

Each step runs the stages in order on the same BatchInput, the hidden states of one stage feeding the next;
each stage writes its own layers' K/V into its own pools at the block ids the one BlockManager chose, so the
scheduler, prefix caching and preemption see one runner. `chain` is where the stages live: StageRunners in this
process (open_pipeline_runner), or Ray actors (ray_stages.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.contract import KvPoolSpec
from kiln.errors import KilnError
from kiln.manifest import EngineLoadError, Manifest
from kiln.pipeline_stages import PipelineStage
from kiln.runtime.kv_transfer import KvLayout
from kiln.runtime.model_runner import BatchInput, ModelRunner, RunnerOutput
from kiln.runtime.pipeline.shape import PipelineShape
from kiln.runtime.pipeline.stage import StageResult, StageRunner

StageChain = Callable[[BatchInput], StageResult]  # one step through every stage; the last stage's result


@dataclass
class PipelineStats:
    """What the stages did since the runner opened: per-stage seconds, hidden-state bytes handed on, tokens."""

    stage_seconds: list[float]
    bytes_moved: int = 0
    tokens: int = 0
    steps: int = 0
    stage_layers: list[tuple[int, int]] = field(default_factory=list)  # [first, end) of each stage

    def add(self, result: StageResult, tokens: int) -> None:
        for index, seconds in enumerate(result.seconds):
            self.stage_seconds[index] += seconds
        self.bytes_moved += result.bytes_moved
        self.tokens += tokens
        self.steps += 1


class PipelineRunner(ModelRunner):
    """Runs each step through `chain` (every stage in order); pools described by `pools`, split by stage."""

    def __init__(self, chain: StageChain, stages: tuple[PipelineStage, ...], pools: KvPoolSpec,
                 shape: PipelineShape) -> None:
        self.chain, self.stages, self.pool_spec = chain, stages, pools
        self.num_blocks, self.block_size, self.vocab_size = shape.num_blocks, pools.block_size, shape.vocab_size
        self.num_medusa_heads, self.medusa_output = shape.num_medusa_heads, shape.medusa_output
        self.stats = PipelineStats([0.0] * len(stages), stage_layers=[(s.first_layer, s.end_layer) for s in stages])
        self.local_stages: list[StageRunner] = []  # set by open_pipeline_runner: in-process stages (KV transfer)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.pool_spec.bytes_per_block

    def execute(self, batch: BatchInput) -> np.ndarray:
        return self.execute_all(batch).logits

    def execute_all(self, batch: BatchInput) -> RunnerOutput:
        if not self.num_medusa_heads and batch.medusa_indices is not None and len(batch.medusa_indices):
            raise ValueError("this engine has no Medusa heads (it was built without --medusa); "
                             "leave medusa_indices unset")
        result = self.chain(batch)
        assert result.output is not None  # the last stage returns the step's output
        self.stats.add(result, batch.num_tokens)
        return result.output

    def kv_layout(self) -> KvLayout:
        pools = self._local("export or import KV blocks")
        return KvLayout(self.pool_spec.num_layers, pools[0].pools[0].shape[1:], pools[0].pools[0].dtype)

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        return np.concatenate([stage.read_kv_blocks(block_ids) for stage in self._local("export KV blocks")])

    def write_kv_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        for stage in self._local("import KV blocks"):
            stage.write_kv_blocks(block_ids, blocks[stage.stage.first_layer:stage.stage.end_layer])

    def _local(self, what: str) -> list[StageRunner]:
        if not self.local_stages:
            raise KilnError(f"a pipeline whose stages run in other processes cannot {what}")
        return self.local_stages

    def close(self) -> None:
        for stage in self.local_stages:
            stage.close()


def open_stage(engine_dir: Path, stage: PipelineStage, pools: KvPoolSpec, num_blocks: int,
               num_threads: int | None) -> StageRunner:
    """One stage's session (num_threads each) with its layers' pools."""
    from kiln.runtime.ort_runner import open_session

    return StageRunner(open_session(engine_dir / stage.graph, num_threads), stage, pools, num_blocks)


def open_pipeline_runner(engine_dir: Path, manifest: Manifest, num_blocks: int,
                         num_threads: int | None) -> PipelineRunner:
    """A staged engine's stages as sessions in this process (num_threads each), run one after another."""
    from kiln.runtime.loader import engine_kv_pools

    pools = engine_kv_pools(manifest)
    stages = [open_stage(engine_dir, stage, pools, num_blocks, num_threads) for stage in manifest.stages]
    if not stages[-1].is_last or any(stage.is_last for stage in stages[:-1]):
        raise EngineLoadError(f"the last pipeline stage of {engine_dir} must be the only one with logits")

    def chain(batch: BatchInput) -> StageResult:
        result = None
        for stage in stages:
            result = stage.run(batch, result)
        assert result is not None
        return result

    runner = PipelineRunner(chain, manifest.stages, pools, stages[-1].shape(num_blocks))
    runner.local_stages = stages
    return runner
