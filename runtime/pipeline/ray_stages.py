"""The stages of a pipeline in Ray actors (kiln serve --pipeline-parallel N): one actor per stage, each with
its session, its layers' KV pools and its own threads, in a placement group that may span machines.

A step is one chain of direct actor calls per micro-batch: stage k+1's call takes the ObjectRef of stage k's
result, so Ray hands the hidden states from actor to actor (inline in the call while small, through the object
store once larger). Every call of the step is submitted before the engine process waits on the last stage's
results; each actor runs its calls in submission order, so stage k computes micro-batch j while stage k+1
computes micro-batch j-1. The actors run in the engine's own Ray (a local
one started here, or the cluster RAY_ADDRESS names); their nodes need kiln and the engine dir at the same path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.manifest import EngineLoadError
from kiln.pipeline_stages import PipelineStage
from kiln.runtime.model_runner import BatchInput, KvLostError
from kiln.runtime.pipeline.runner import PipelineRunner, StageChain, check_last_stage
from kiln.runtime.pipeline.shape import PipelineShape, StageSizing
from kiln.runtime.pipeline.stage import StageResult

log = logging.getLogger("kiln.pipeline")


class StageActor:
    """One stage in a Ray actor: the methods the driver's RayChain calls (ray.remote wraps this class)."""

    def __init__(self, engine_dir: str, stage: PipelineStage, sizing: StageSizing) -> None:
        from kiln.runtime.pipeline.memory import limit_memory_growth
        from kiln.runtime.pipeline.runner import open_stage

        if sizing.memory_budget_bytes is not None:  # enforced by the kernel, unlike Ray's memory= hint
            limit_memory_growth(sizing.memory_budget_bytes)
        self.runner = open_stage(Path(engine_dir), stage, sizing)

    def describe(self, num_blocks: int) -> StageDescription:
        """Whether it is the last stage, the pipeline's shape as its graph gives it, its pid and load's memory."""
        runner = self.runner
        shape = runner.shape(num_blocks) if runner.is_last else PipelineShape(num_blocks, runner.output_width)
        return StageDescription(runner.is_last, shape, os.getpid(), runner.load_resident_bytes)

    def pid(self) -> int:
        return os.getpid()

    def run(self, batch: BatchInput, previous: StageResult | None) -> StageResult:
        return self.runner.run(batch, previous)

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        return self.runner.read_kv_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        self.runner.write_kv_blocks(block_ids, blocks)


@dataclass(frozen=True)
class StageDescription:
    is_last: bool
    shape: PipelineShape
    pid: int
    load_resident_bytes: int


@dataclass
class StageLauncher:
    """Starts the actor of stage k in bundle k of the pipeline's placement group: at open, and again when it dies."""

    engine_dir: Path
    stages: tuple[PipelineStage, ...]
    sizing: StageSizing
    placement: Any

    def start(self, index: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote: Any = ray.remote(StageActor)
        threads = self.sizing.num_threads or 1
        return remote.options(num_cpus=threads, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.placement, placement_group_bundle_index=index)).remote(
            str(self.engine_dir.resolve()), self.stages[index], self.sizing)


class RayChain(StageChain):
    """The stages as Ray actors; each step one chain of calls per micro-batch, the engine waiting on the last.

    A stage actor that dies (its process killed, its node lost) is started again in its bundle, reloading its
    stage graph, and the step raises KvLostError: the new actor's pools are empty, so no block the engine's
    BlockManager holds has its K/V on every stage any more."""

    def __init__(self, actors: list[Any], launcher: StageLauncher, described: list[StageDescription]) -> None:
        self.actors, self.launcher = actors, launcher
        self.pids = [d.pid for d in described]
        self.resident_bytes = [d.load_resident_bytes for d in described]
        self.restarts = 0
        self.overlaps = True

    def run(self, batches: list[BatchInput]) -> list[StageResult]:
        import ray

        last = []
        for batch in batches:
            ref: Any = None
            for actor in self.actors:
                ref = actor.run.remote(batch, ref)
            last.append(ref)
        try:
            results: list[StageResult] = ray.get(last)
        except ray.exceptions.RayActorError as exc:
            raise self._recover(exc) from exc
        return results

    def _recover(self, cause: Exception) -> KvLostError:
        """Start again every stage actor that is dead; the error the step raises."""
        import ray

        dead = []
        for index, actor in enumerate(self.actors):
            try:
                ray.get(actor.pid.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                dead.append(index)
        if not dead:  # the call failed, yet every actor answers: nothing was restarted, but the step's K/V is partial
            return KvLostError(f"a pipeline stage call failed ({cause.__class__.__name__}); the step's K/V is lost")
        for index in dead:
            ray.kill(self.actors[index])
            self.actors[index] = self.launcher.start(index)
        try:
            described = ray.get([self.actors[i].describe.remote(self.launcher.sizing.num_blocks) for i in dead])
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"pipeline stages {dead} died and could not be started again: {exc}") from exc
        for index, description in zip(dead, described, strict=True):
            log.warning("pipeline stage %d (pid %d) died; started again as pid %d", index, self.pids[index],
                        description.pid)
            self.pids[index], self.resident_bytes[index] = description.pid, description.load_resident_bytes
        self.restarts += len(dead)
        return KvLostError(f"pipeline stage{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died and "
                           f"{'were' if len(dead) > 1 else 'was'} restarted; the K/V of the running requests is lost")

    def read_kv_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        import ray

        return list(ray.get([actor.read_kv_blocks.remote(block_ids) for actor in self.actors]))

    def write_kv_blocks(self, block_ids: list[int], per_stage: list[np.ndarray]) -> None:
        import ray

        ray.get([a.write_kv_blocks.remote(block_ids, b) for a, b in zip(self.actors, per_stage, strict=True)])

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.launcher.placement)


def last_line(exc: Exception) -> str:
    """The error a Ray exception carries without the remote traceback Ray puts before it."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def connect_ray(num_cpus: int) -> None:
    """ray.init: the cluster RAY_ADDRESS names, else a local Ray with CPUs for every stage (no dashboard, actor
    logs not forwarded). Nothing when Ray is already up (e.g. inside a replica of kiln serve --replicas)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report: this machine has no network
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, num_cpus), include_dashboard=False, log_to_driver=False,
                 object_store_memory=256 * 2**20, logging_level=logging.WARNING)


def open_ray_pipeline_runner(engine_dir: Path, stages: tuple[PipelineStage, ...], sizing: StageSizing,
                             num_actors: int, micro_batches: int | None = None) -> PipelineRunner:
    """The engine's stages in num_actors Ray actors (which must be its stage count), sizing.num_threads CPUs each;
    each step as micro_batches micro-batches in flight (None: one per stage)."""
    if num_actors != len(stages):
        have = f"{len(stages)} pipeline stages" if stages else "one graph (no pipeline stages)"
        raise EngineLoadError(f"--pipeline-parallel {num_actors} needs an engine of {num_actors} stages, and "
                              f"{engine_dir} has {have}; build it with kiln build --pipeline-stages {num_actors}")
    import ray
    from ray.util.placement_group import placement_group

    threads = sizing.num_threads or 1
    num_blocks = sizing.num_blocks
    connect_ray(num_actors * threads)
    # one bundle per stage, spread over nodes where the cluster has several (packed on one machine otherwise)
    group = placement_group([{"CPU": threads}] * num_actors, strategy="SPREAD")
    ray.get(group.ready())
    launcher = StageLauncher(engine_dir, stages, dataclasses.replace(sizing, num_threads=threads), group)
    actors: list[Any] = [launcher.start(index) for index in range(num_actors)]
    try:
        described = ray.get([actor.describe.remote(num_blocks) for actor in actors])
    except ray.exceptions.RayError as exc:
        for actor in actors:
            ray.kill(actor)
        cap = sizing.memory_budget_bytes
        hint = f" (is --stage-memory-bytes {cap} too small for its graph?)" if cap and "alloc" in str(exc) else ""
        raise EngineLoadError(f"a pipeline stage actor failed to open its stage: {last_line(exc)}{hint}") from exc
    check_last_stage([d.is_last for d in described], engine_dir)
    log.info("pipeline of %d stages in Ray actors (pids %s), %d thread(s) each; their graphs added %s MiB resident",
             num_actors, [d.pid for d in described], threads, [d.load_resident_bytes >> 20 for d in described])
    return PipelineRunner(RayChain(actors, launcher, described), stages, sizing.pools, described[-1].shape,
                          micro_batches)
