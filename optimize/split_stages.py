"""Split an engine graph into pipeline stages, one graph per contiguous layer range (kiln/pipeline_stages.py).

The cut is the residual stream between layers. In an optimized graph layer L begins with the fused residual
norm SkipSimplifiedLayerNormalization(residual, delta) that feeds its attention: the stage before the cut ends
with `Add(residual, delta)` (the same float32 sum the fused op computes) as `hidden_states_out`, and the stage
after it runs the fused op on (hidden_states, zeros), whose sum is hidden_states exactly: so every stage
computes bit for bit what the single graph computes, and every pass and quantization scheme stays as it is.

Each stage is the original graph with the cut made and everything its outputs do not read removed (a layer's
nodes, other layers' pools, the embedding or the head); the position and block-table preparation that all
layers share stays in every stage that reads it. Weights are copied from the engine's external-data file
tensor by tensor into the stage's own, so no stage loads another's weights.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from kiln import contract
from kiln.errors import KilnError
from kiln.manifest import BACKEND_ORT_CPU, Manifest, read_manifest, write_manifest
from kiln.optimize._common import prune_graph, write_weights
from kiln.pipeline_stages import HIDDEN_STATES, HIDDEN_STATES_OUT, PipelineStage, stage_graph_name, stage_layer_ranges

_RESIDUAL_NORM = "SkipSimplifiedLayerNormalization"
_KV_INPUT = re.compile(r"^kv_cache\.(\d+)$")


class StageSplitError(KilnError, ValueError):
    """The graph cannot be cut into the asked stages; the message names the layer and why."""


@dataclass(frozen=True)
class _Cut:
    """Layer L's fused residual norm: its inputs (residual, delta, weight...) and the node itself."""

    node: onnx.NodeProto


def split_engine_graph(graph_path: Path, out_dir: Path, ranges: list[range], hidden_size: int) -> list[PipelineStage]:
    """Write one graph (+ its .data) per layer range into out_dir; the stages, in order."""
    model = onnx.load(str(graph_path), load_external_data=False)
    attention = _attention_layers(model.graph)
    cuts = {r.start: _find_cut(model.graph, attention, r.start) for r in ranges[1:]}
    stages = []
    for index, layers in enumerate(ranges):
        first, last = index == 0, index == len(ranges) - 1
        stage = _stage_graph(model.graph, None if first else cuts[layers.start],
                             None if last else cuts[layers.stop], layers, hidden_size)
        _check_layers(stage, layers)
        name = stage_graph_name(index)
        stage_model = helper.make_model(stage, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                                        producer_name=model.producer_name, producer_version=model.producer_version)
        write_weights(stage_model.graph, graph_path.parent, out_dir / f"{name}.data", f"{name}.data")
        (out_dir / name).write_bytes(stage_model.SerializeToString())
        stages.append(PipelineStage(name, layers.start, layers.stop))
    return stages


def _attention_layers(graph: onnx.GraphProto) -> dict[int, onnx.NodeProto]:
    """kiln.PagedAttention nodes by the layer of the pool they read (kv_cache.{i})."""
    layers = {}
    for node in graph.node:
        if node.domain == contract.OP_DOMAIN and node.op_type == contract.OP_TYPE:
            index = next((int(m.group(1)) for m in map(_KV_INPUT.match, node.input) if m), None)
            if index is not None:
                layers[index] = node
    return layers


def _find_cut(graph: onnx.GraphProto, attention: dict[int, onnx.NodeProto], layer: int) -> _Cut:
    """The fused residual norm nearest above layer's attention query (its input 0)."""
    if layer not in attention:
        raise StageSplitError(f"the graph has no kiln.PagedAttention reading {contract.kv_cache_input(layer)}; "
                              "it cannot be cut before that layer")
    producer = {out: node for node in graph.node for out in node.output}
    frontier, seen = [attention[layer].input[0]], set()
    while frontier:
        name = frontier.pop(0)
        node = producer.get(name)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == _RESIDUAL_NORM:
            if len(node.output) < 4 or not node.output[3]:
                raise StageSplitError(f"layer {layer}'s residual norm does not output the residual sum")
            return _Cut(node)
        if node.op_type == contract.OP_TYPE:
            break  # reached an earlier layer without passing a residual norm
        frontier.extend(node.input)
    raise StageSplitError(f"layer {layer} does not begin with a fused residual norm ({_RESIDUAL_NORM}) before its "
                          "attention, so the graph has no residual-stream tensor to cut at there")


def _stage_graph(graph: onnx.GraphProto, start: _Cut | None, end: _Cut | None, layers: range,
                 hidden_size: int) -> onnx.GraphProto:
    """The graph of one stage: the cut at `start` (None: the first stage), outputs up to `end` (None: the last)."""
    nodes: list[onnx.NodeProto] = []
    inputs = [i for i in graph.input if not _KV_INPUT.match(i.name)]
    kv_inputs = [i for i in graph.input if (m := _KV_INPUT.match(i.name)) and int(m.group(1)) in layers]
    kv_outputs = {contract.kv_cache_output(i) for i in layers}
    outputs = [o for o in graph.output if o.name in kv_outputs]
    if start is not None:
        hidden_3d, zeros, axes = f"{HIDDEN_STATES}.3d", f"{HIDDEN_STATES}.zeros", f"{HIDDEN_STATES}.axes"
        nodes += [helper.make_node("Constant", [], [axes], value=helper.make_tensor(axes, TensorProto.INT64, [1], [0])),
                  helper.make_node("Unsqueeze", [HIDDEN_STATES, axes], [hidden_3d]),
                  helper.make_node("Shape", [hidden_3d], [f"{hidden_3d}.shape"]),
                  helper.make_node("ConstantOfShape", [f"{hidden_3d}.shape"], [zeros],
                                   value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))]
        inputs = [i for i in inputs if i.name != contract.INPUT_IDS]
        inputs.append(helper.make_tensor_value_info(HIDDEN_STATES, TensorProto.FLOAT, ["num_tokens", hidden_size]))
    for node in graph.node:
        if start is not None and node is start.node:
            fused = onnx.NodeProto()
            fused.CopyFrom(node)
            fused.input[0], fused.input[1] = hidden_3d, zeros
            node = fused
        nodes.append(node)
    if end is not None:
        summed, out_axes = f"{HIDDEN_STATES_OUT}.3d", f"{HIDDEN_STATES_OUT}.axes"
        nodes += [helper.make_node("Add", list(end.node.input[:2]), [summed]),
                  helper.make_node("Constant", [], [out_axes],
                                   value=helper.make_tensor(out_axes, TensorProto.INT64, [1], [0])),
                  helper.make_node("Squeeze", [summed, out_axes], [HIDDEN_STATES_OUT])]
        outputs = [helper.make_tensor_value_info(HIDDEN_STATES_OUT, TensorProto.FLOAT, ["num_tokens", hidden_size]),
                   *outputs]
    else:
        outputs = [o for o in graph.output if not o.name.startswith("kv_cache_out.")] + outputs
    # the first stage declares the tokens' inputs as the one graph does, read or not (RoPE inside the attention
    # op reads no position_ids); other stages declare only what they read
    keep = {contract.INPUT_IDS, contract.POSITION_IDS} if start is None else set()
    return prune_graph(graph, nodes, inputs + kv_inputs, outputs, keep)


def _check_layers(stage: onnx.GraphProto, layers: range) -> None:
    found = sorted(_attention_layers(stage))
    if found != list(layers):
        raise StageSplitError(f"the stage of layers {layers.start}..{layers.stop - 1} reads the attention of layers "
                              f"{found}: the residual stream is not the only tensor its layers share with others")


def split_into_stages(engine_dir: Path, spec, count: int, say) -> tuple[PipelineStage, ...]:
    """Replace engine_dir's model.onnx (+ .data) by `count` stage graphs (none for count 1); the stages."""
    if count == 1:
        return ()
    graph = engine_dir / "model.onnx"
    stages = split_engine_graph(graph, engine_dir, stage_layer_ranges(spec.num_layers, count), spec.hidden_size)
    for stage in stages:
        size = (engine_dir / f"{stage.graph}.data").stat().st_size
        say(f"  {stage.graph}: layers {stage.first_layer}..{stage.end_layer - 1}, {size / 2**20:.1f} MiB of weights")
    graph.unlink()
    (engine_dir / "model.onnx.data").unlink(missing_ok=True)
    return tuple(stages)


def split_engine(engine_dir: Path, out_dir: Path, count: int) -> Manifest:
    """A staged copy of a one-graph engine: its graph cut into `count` stages, its other files copied, and its
    manifest with the stages (what `kiln build --pipeline-stages` writes, without rebuilding)."""
    engine_dir, out_dir = Path(engine_dir), Path(out_dir)
    manifest = read_manifest(engine_dir)
    if manifest.stages:
        raise StageSplitError(f"{engine_dir} is already split into {len(manifest.stages)} pipeline stages")
    if manifest.backend != BACKEND_ORT_CPU:
        raise StageSplitError(f"pipeline stages are built for the {BACKEND_ORT_CPU} backend, not {manifest.backend}")
    out_dir.mkdir(parents=True)
    for name in manifest.files:
        if not name.startswith("model.onnx"):
            shutil.copy2(engine_dir / name, out_dir / name)
    ranges = stage_layer_ranges(manifest.spec.num_layers, count)
    stages = split_engine_graph(engine_dir / "model.onnx", out_dir, ranges, manifest.spec.hidden_size)
    build = dataclasses.replace(manifest.build, pipeline_stages=count)
    return write_manifest(out_dir, dataclasses.replace(manifest, build=build, stages=tuple(stages), files={}))
