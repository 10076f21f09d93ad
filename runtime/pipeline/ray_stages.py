"""The stages of a pipeline in Ray actors (kiln serve --pipeline-parallel N): one actor per stage, each with
its session, its layers' KV pools and its own threads, in a placement group that may span machines.

A step is one chain of direct actor calls: stage k+1's call takes the ObjectRef of stage k's result, so Ray
hands the hidden states from actor to actor (inline in the call while small, through the object store once
larger) and the engine process waits only for the last stage. The actors run in the engine's own Ray (a local
one started here, or the cluster RAY_ADDRESS names); their nodes need kiln and the engine dir at the same path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from kiln.manifest import EngineLoadError
from kiln.pipeline_stages import PipelineStage
from kiln.runtime.model_runner import BatchInput
from kiln.runtime.pipeline.runner import PipelineRunner, StageChain, check_last_stage
from kiln.runtime.pipeline.shape import PipelineShape, StageSizing
from kiln.runtime.pipeline.stage import StageResult

log = logging.getLogger("kiln.pipeline")


class StageActor:
    """One stage in a Ray actor: the methods the driver's RayChain calls (ray.remote wraps this class)."""

    def __init__(self, engine_dir: str, stage: PipelineStage, sizing: StageSizing) -> None:
        from kiln.runtime.pipeline.runner import open_stage

        self.runner = open_stage(Path(engine_dir), stage, sizing)

    def describe(self, num_blocks: int) -> tuple[bool, PipelineShape, int]:
        """Whether it is the last stage, the pipeline's shape as its graph gives it, its pid."""
        return self.runner.is_last, self.runner.shape(num_blocks) if self.runner.is_last else \
            PipelineShape(num_blocks, self.runner.output_width), os.getpid()

    def run(self, batch: BatchInput, previous: StageResult | None) -> StageResult:
        return self.runner.run(batch, previous)

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        return self.runner.read_kv_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        self.runner.write_kv_blocks(block_ids, blocks)


class RayChain(StageChain):
    """The stages as Ray actors; each step one chain of calls, the engine waiting on the last."""

    def __init__(self, actors: list[Any], placement: Any) -> None:
        self.actors, self.placement = actors, placement

    def run(self, batch: BatchInput) -> StageResult:
        import ray

        ref: Any = None
        for actor in self.actors:
            ref = actor.run.remote(batch, ref)
        try:
            result: StageResult = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"a pipeline stage actor died ({exc.__class__.__name__}): {exc}") from exc
        return result

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
        remove_placement_group(self.placement)


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
                             num_actors: int) -> PipelineRunner:
    """The engine's stages in num_actors Ray actors (which must be its stage count), sizing.num_threads CPUs each."""
    if num_actors != len(stages):
        have = f"{len(stages)} pipeline stages" if stages else "one graph (no pipeline stages)"
        raise EngineLoadError(f"--pipeline-parallel {num_actors} needs an engine of {num_actors} stages, and "
                              f"{engine_dir} has {have}; build it with kiln build --pipeline-stages {num_actors}")
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    threads = sizing.num_threads or 1
    num_blocks = sizing.num_blocks
    connect_ray(num_actors * threads)
    # one bundle per stage, spread over nodes where the cluster has several (packed on one machine otherwise)
    group = placement_group([{"CPU": threads}] * num_actors, strategy="SPREAD")
    ray.get(group.ready())
    remote: Any = ray.remote(StageActor)
    sizing = StageSizing(sizing.pools, num_blocks, threads)
    actors: list[Any] = [remote.options(num_cpus=threads, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index)).remote(
        str(engine_dir.resolve()), stage, sizing) for index, stage in enumerate(stages)]
    try:
        described = ray.get([actor.describe.remote(num_blocks) for actor in actors])
    except ray.exceptions.RayError as exc:
        for actor in actors:
            ray.kill(actor)
        raise EngineLoadError(f"a pipeline stage actor failed to open its stage: {exc}") from exc
    check_last_stage([is_last for is_last, _, _ in described], engine_dir)
    log.info("pipeline of %d stages in Ray actors (pids %s), %d thread(s) each", num_actors,
             [pid for _, _, pid in described], threads)
    return PipelineRunner(RayChain(actors, group), stages, sizing.pools, described[-1][1])
