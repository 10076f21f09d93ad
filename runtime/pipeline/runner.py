"""PipelineRunner: an engine's stages behind the one ModelRunner interface the Engine drives.

Each step runs the stages in order on the same BatchInput, the hidden states of one stage feeding the next,
or on each of its micro-batches (micro_batch.py: whole sequences), which stages in their own processes overlap;
each stage writes its own layers' K/V into its own pools at the block ids the one BlockManager chose, so the
scheduler, prefix caching, preemption and speculative verification see one runner. A StageChain is where the
stages live: StageRunners in this process (LocalChain, here), or Ray actors (ray_stages.RayChain).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.contract import KvPoolSpec
from kiln.manifest import EngineLoadError
from kiln.pipeline_stages import PipelineStage
from kiln.runtime.kv_transfer import KvLayout
from kiln.runtime.model_runner import BatchInput, ModelRunner, RunnerOutput
from kiln.runtime.outputs import StageTotals
from kiln.runtime.pipeline.micro_batch import join_outputs, micro_batch_count, split_batch
from kiln.runtime.pipeline.shape import PipelineShape, StageSizing
from kiln.runtime.pipeline.stage import StageResult, StageRunner


class StageChain(abc.ABC):
    """The stages of one pipeline, wherever they run: one step through all of them, their KV blocks, close."""

    resident_bytes: list[int]  # per stage, the resident memory its graph's load added
    restarts: int = 0  # stage processes that died and were started again
    overlaps: bool = False  # whether stage k+1 can run one micro-batch while stage k runs the next

    @abc.abstractmethod
    def run(self, batches: list[BatchInput]) -> list[StageResult]:
        """Each batch through every stage in order (a stage runs the batches in list order): the last stage's
        result of each."""

    @abc.abstractmethod
    def read_kv_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        """Each stage's blocks, [its layers, len(block_ids), *block_shape], in stage order."""

    @abc.abstractmethod
    def write_kv_blocks(self, block_ids: list[int], per_stage: list[np.ndarray]) -> None:
        """Overwrite each stage's blocks with read_kv_blocks' layout."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the stages (their sessions, pools, processes)."""


class LocalChain(StageChain):
    """The stages as sessions in this process, run one after another (micro-batches too: nothing overlaps)."""

    def __init__(self, stages: list[StageRunner]) -> None:
        self.stages = stages
        self.resident_bytes = [stage.load_resident_bytes for stage in stages]

    def run(self, batches: list[BatchInput]) -> list[StageResult]:
        results = []
        for batch in batches:
            result = None
            for stage in self.stages:
                result = stage.run(batch, result)
            assert result is not None  # a pipeline has at least two stages
            results.append(result)
        return results

    def read_kv_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        return [stage.read_kv_blocks(block_ids) for stage in self.stages]

    def write_kv_blocks(self, block_ids: list[int], per_stage: list[np.ndarray]) -> None:
        for stage, blocks in zip(self.stages, per_stage, strict=True):
            stage.write_kv_blocks(block_ids, blocks)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


@dataclass
class PipelineStats:
    """What the stages did since the runner opened: per-stage seconds, hidden-state bytes handed on, tokens."""

    stage_layers: list[tuple[int, int]]  # [first, end) of each stage
    stage_seconds: list[float] = field(default_factory=list)
    bytes_moved: int = 0
    tokens: int = 0
    steps: int = 0
    micro_batches: int = 0  # a step run whole counts one

    def __post_init__(self) -> None:
        self.stage_seconds = [0.0] * len(self.stage_layers)

    def add(self, results: list[StageResult], tokens: int) -> None:
        """One step's results, one per micro-batch."""
        for result in results:
            for index, seconds in enumerate(result.seconds):
                self.stage_seconds[index] += seconds
            self.bytes_moved += result.bytes_moved
        self.tokens += tokens
        self.steps += 1
        self.micro_batches += len(results)


class PipelineRunner(ModelRunner):
    """Runs each step through `chain` (every stage in order), as micro_batches micro-batches (None: one per stage
    where the chain's stages overlap, else the step whole); pools described by `pools`, split by stage."""

    def __init__(self, chain: StageChain, stages: tuple[PipelineStage, ...], pools: KvPoolSpec,
                 shape: PipelineShape, micro_batches: int | None = None) -> None:
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"a pipeline step runs as at least 1 micro-batch, got {micro_batches}")
        self.chain, self.stages, self.pool_spec, self.micro_batches = chain, stages, pools, micro_batches
        self.num_blocks, self.block_size, self.vocab_size = shape.num_blocks, pools.block_size, shape.vocab_size
        self.num_medusa_heads, self.medusa_output = shape.num_medusa_heads, shape.medusa_output
        self.stats = PipelineStats([(s.first_layer, s.end_layer) for s in stages])

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.pool_spec.bytes_per_block

    def execute(self, batch: BatchInput) -> np.ndarray:
        return self.execute_all(batch).logits

    def execute_all(self, batch: BatchInput) -> RunnerOutput:
        if self.medusa_output is None and batch.medusa_indices is not None and len(batch.medusa_indices):
            raise ValueError("this engine has no Medusa heads (it was built without --medusa); "
                             "leave medusa_indices unset")
        count = micro_batch_count(self.micro_batches, len(self.stages), len(batch.seq_lens), self.chain.overlaps)
        pieces = split_batch(batch, count)
        results = self.chain.run([piece.batch for piece in pieces])
        outputs = [result.output for result in results]
        assert all(output is not None for output in outputs)  # the last stage returns its batch's output
        self.stats.add(results, batch.num_tokens)
        return join_outputs(batch, pieces, [output for output in outputs if output is not None])

    def stage_totals(self) -> StageTotals:
        stats, chain = self.stats, self.chain
        return StageTotals(tuple(stats.stage_seconds), stats.bytes_moved, stats.tokens, tuple(chain.resident_bytes),
                           chain.restarts)

    def kv_layout(self) -> KvLayout:
        pools = self.pool_spec
        return KvLayout(pools.num_layers, pools.pool_shape(1)[1:], pools.dtype)

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        return np.concatenate(self.chain.read_kv_blocks(block_ids))

    def write_kv_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        self.chain.write_kv_blocks(block_ids, [blocks[s.first_layer:s.end_layer] for s in self.stages])

    def close(self) -> None:
        self.chain.close()


def open_stage(engine_dir: Path, stage: PipelineStage, sizing: StageSizing) -> StageRunner:
    """One stage's session with its layers' pools; its load_resident_bytes what the load added to this process's
    resident memory (the pools are calloc'd, resident only once written: this is the weights and the session)."""
    from kiln.runtime.ort_runner import open_session
    from kiln.runtime.pipeline.memory import resident_bytes

    before = resident_bytes()
    session = open_session(engine_dir / stage.graph, sizing.num_threads)
    runner = StageRunner(session, stage, sizing.pools, sizing.num_blocks)
    runner.load_resident_bytes = resident_bytes() - before
    return runner


def check_last_stage(is_last: list[bool], engine_dir: Path) -> None:
    if not is_last[-1] or any(is_last[:-1]):
        raise EngineLoadError(f"the last pipeline stage of {engine_dir} must be the only one with logits")


def open_pipeline_runner(engine_dir: Path, stages: tuple[PipelineStage, ...], sizing: StageSizing,
                         micro_batches: int | None = None) -> PipelineRunner:
    """A staged engine's stages as sessions in this process, run one after another."""
    runners = [open_stage(engine_dir, stage, sizing) for stage in stages]
    check_last_stage([runner.is_last for runner in runners], engine_dir)
    return PipelineRunner(LocalChain(runners), stages, sizing.pools, runners[-1].shape(sizing.num_blocks),
                          micro_batches)
