"""Pipeline stages of an engine: contiguous layer ranges, each its own graph (kiln build --pipeline-stages N).

A staged engine holds one graph per stage instead of model.onnx. The first stage embeds input_ids and runs
its layers; each later stage starts from the residual stream the previous one ends with, `hidden_states`
float32 [num_tokens, hidden_size]; the last runs the final norm and the LM head. Each stage's graph has the
KV pools (kv_cache.{i}) of its own layers only, under their engine-wide layer numbers, and every feed of
kiln/contract.py that it reads (block tables, positions, ...); the runtime binds what a stage declares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError

HIDDEN_STATES = "hidden_states"  # a later stage's input: the residual stream entering its first layer
HIDDEN_STATES_OUT = "hidden_states_out"  # an earlier stage's output: the residual stream after its last layer


def stage_graph_name(index: int) -> str:
    return f"stage{index}.onnx"


@dataclass(frozen=True)
class PipelineStage:
    """One stage: its graph file (relative to the engine dir) and its layers [first_layer, end_layer)."""

    graph: str
    first_layer: int
    end_layer: int

    def __post_init__(self) -> None:
        if not 0 <= self.first_layer < self.end_layer:
            raise ValueError(f"pipeline stage {self.graph} has the empty or negative layer range "
                             f"[{self.first_layer}, {self.end_layer})")

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "first_layer": self.first_layer, "end_layer": self.end_layer}


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """num_stages contiguous ranges covering the layers, sizes differing by at most one (earlier stages larger:
    the last stage also runs the LM head)."""
    if num_stages < 1:
        raise KilnError(f"the pipeline stage count must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise KilnError(f"{num_stages} pipeline stages are more than the model's {num_layers} layers; each stage "
                        f"needs at least one layer (use --pipeline-stages {num_layers} or fewer)")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for index in range(num_stages):
        end = start + base + (1 if index < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


def check_stages(stages: tuple[PipelineStage, ...], num_layers: int) -> None:
    """Stages must cover [0, num_layers) in order, without gaps or overlap (ValueError naming the first that does
    not)."""
    expected = 0
    for stage in stages:
        if stage.first_layer != expected:
            raise ValueError(f"pipeline stage {stage.graph} starts at layer {stage.first_layer}, not at layer "
                             f"{expected} where the previous stage ends")
        expected = stage.end_layer
    if stages and expected != num_layers:
        raise ValueError(f"the pipeline stages end at layer {expected}, but the model has {num_layers} layers")
