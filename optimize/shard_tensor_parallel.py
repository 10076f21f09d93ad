"""Split an engine graph into tensor-parallel rank graphs (kiln/tensor_parallel.py says what each rank computes).

Works on the finished graph, where each layer is a few fused nodes:
    MatMul(x, W_qkv) -> kiln.PagedAttention (packed QKV) -> MatMul(., W_o) -> SkipSimplifiedLayerNormalization
    -> MatMul(., W_gate_up) -> kiln.SwiGLU -> MatMul(., W_down) -> (next layer's norm | final Add)
Rank r keeps its columns of W_qkv (its query heads, then its K heads, then its V heads: the packed layout the op
reads) and of W_gate_up (its gate columns, then the same up columns: SwiGLU's halves), its rows of W_o and W_down,
and its KV heads in the pool's shape and the attention's attributes. The output of each row-sharded MatMul becomes
its partial sum, and a kiln.AllReduce on it writes the tensor the rest of the graph reads, so everything past it
(the residual adds, the norms) is the one graph's. The linears are float32 MatMuls or kiln.MatMulQ4_1 nodes
(shard_weights.py slices both); a rank's external-data file holds its slices and the replicated tensors it reads
(rank 0 the LM head, in whatever form the build gave it).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln import all_reduce, contract
from kiln.manifest import BACKEND_ORT_CPU, BuildOptions, Manifest, read_manifest, write_manifest
from kiln.optimize._common import prune_graph, write_weights
from kiln.optimize.shard_weights import WeightReader, column_slices, describe, is_linear, row_slices
from kiln.spec import ModelSpec
from kiln.swiglu import OP_TYPE as SWIGLU
from kiln.tensor_parallel import TP_HIDDEN, ShardShape, TensorParallelError, TensorRank, plan_ranks

_KV_INPUT = re.compile(r"^kv_cache\.(\d+)$")
_INLINE_BYTES = 1024  # slices smaller than this stay inside the graph
SPLIT_SCHEMES = ("none", "int4-q4_1")  # weights the split reads: float32 MatMul, kiln.MatMulQ4_1 (shard_weights.py)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """The nodes of one layer the split rewrites."""

    qkv: onnx.NodeProto
    attention: onnx.NodeProto
    out_proj: onnx.NodeProto
    gate_up: onnx.NodeProto
    down: onnx.NodeProto


def split_tensor_parallel_graph(graph_path: Path, out_dir: Path, ranks: tuple[TensorRank, ...],
                                shape: ShardShape) -> None:
    """Write rank{r}.onnx (+ .data) for each rank into out_dir."""
    model = onnx.load(str(graph_path), load_external_data=False)
    layers = _find_layers(model.graph, shape)
    weights = WeightReader(model.graph, graph_path.parent)
    for index, rank in enumerate(ranks):
        graph = _rank_graph(model.graph, layers, ranks, index, shape, weights)
        rank_model = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                                       producer_name=model.producer_name, producer_version=model.producer_version)
        data = f"{rank.graph}.data"
        write_weights(rank_model.graph, graph_path.parent, out_dir / data, data, inline_limit=_INLINE_BYTES)
        (out_dir / rank.graph).write_bytes(rank_model.SerializeToString())


def _find_layers(graph: onnx.GraphProto, shape: ShardShape) -> list[_Layer]:
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    initializers = {t.name for t in graph.initializer}
    attention = {}
    for node in graph.node:
        if node.domain == contract.OP_DOMAIN and node.op_type == contract.OP_TYPE:
            layer = next((int(m.group(1)) for m in map(_KV_INPUT.match, node.input) if m), None)
            if layer is not None:
                attention[layer] = node
    if sorted(attention) != list(range(shape.num_layers)):
        raise TensorParallelError(f"the graph's kiln.PagedAttention nodes read the pools of layers "
                                  f"{sorted(attention)}, not of its {shape.num_layers} layers")
    swiglus = [n for n in graph.node if n.domain == contract.OP_DOMAIN and n.op_type == SWIGLU]
    if len(swiglus) != shape.num_layers:
        raise TensorParallelError(f"the graph has {len(swiglus)} kiln.SwiGLU MLPs for {shape.num_layers} layers; "
                                  "tensor parallelism splits gated-SiLU MLPs only")

    def matmul(name: str, what: str, layer: int) -> onnx.NodeProto:
        node = producer.get(name)
        if node is None or not is_linear(node, initializers):
            raise TensorParallelError(f"layer {layer}'s {what} is not a float32 MatMul or a kiln.MatMulQ4_1 with "
                                      f"constant weights (found {describe(node)}); tensor parallelism splits those")
        return node

    def only_reader(name: str, what: str, layer: int) -> onnx.NodeProto:
        readers = consumers.get(name, [])
        if len(readers) != 1 or not is_linear(readers[0], initializers):
            raise TensorParallelError(f"layer {layer}'s {what} is not read by one float32 MatMul or kiln.MatMulQ4_1 "
                                      "alone; tensor parallelism splits those")
        return readers[0]

    layers = []
    for index, swiglu in enumerate(swiglus):
        node = attention[index]
        if len(node.input) < 3 or node.input[1] not in initializers or _numel(graph, node.input[1]) != 0:
            raise TensorParallelError(f"layer {index}'s attention reads separate query, key and value tensors; tensor "
                                      "parallelism splits the packed QKV projection only")
        if len(node.input) > _NORM_SLOT:
            raise TensorParallelError(f"layer {index}'s attention normalises q and k inside kiln.PagedAttention "
                                      "(q_norm / k_norm: Qwen3, Gemma 3, OLMoE); tensor parallelism does not split "
                                      "those yet")
        layers.append(_Layer(matmul(node.input[0], "QKV projection", index), node,
                             only_reader(node.output[0], "attention output", index),
                             matmul(swiglu.input[0], "gate/up projection", index),
                             only_reader(swiglu.output[0], "SwiGLU output", index)))
    return layers


_NORM_SLOT = 11  # kiln.PagedAttention's q_norm input (kiln/paged_attention.py)


def _numel(graph: onnx.GraphProto, name: str) -> int:
    tensor = next(t for t in graph.initializer if t.name == name)
    return int(np.prod(tensor.dims)) if tensor.dims else 1


def _rank_graph(graph: onnx.GraphProto, layers: list[_Layer], ranks: tuple[TensorRank, ...], index: int,
                shape: ShardShape, weights: WeightReader) -> onnx.GraphProto:
    rank, world = ranks[index], len(ranks)
    d, f = shape.head_dim, shape.intermediate_size
    heads, kv = rank.heads, rank.kv_heads
    qkv_columns = np.concatenate([np.arange(heads.start * d, heads.stop * d),
                                  shape.num_heads * d + np.arange(kv.start * d, kv.stop * d),
                                  (shape.num_heads + shape.num_kv_heads) * d + np.arange(kv.start * d, kv.stop * d)])
    out_rows = range(heads.start * d, heads.stop * d)
    cols = np.arange(rank.first_column, rank.end_column)
    gate_up_columns = np.concatenate([cols, f + cols])
    sliced: dict[str, np.ndarray] = {}
    replaced: dict[int, onnx.NodeProto] = {}
    extra_nodes: dict[int, onnx.NodeProto] = {}  # an AllReduce after the node of this id
    for layer in layers:
        sliced |= column_slices(layer.qkv, qkv_columns, weights)
        sliced |= row_slices(layer.out_proj, out_rows, weights)
        sliced |= column_slices(layer.gate_up, gate_up_columns, weights)
        sliced |= row_slices(layer.down, rank.columns, weights)
        attention = onnx.NodeProto()
        attention.CopyFrom(layer.attention)
        for attribute in attention.attribute:
            if attribute.name == "num_heads":
                attribute.i = len(heads)
            elif attribute.name == "num_kv_heads":
                attribute.i = len(kv)
        if len(attention.input) > 7 and attention.input[7] and _numel(graph, attention.input[7]):
            raise TensorParallelError("int8 KV pools (per-head kv_scale) are not split into tensor-parallel ranks")
        replaced[id(layer.attention)] = attention
        for node in (layer.out_proj, layer.down):
            partial = onnx.NodeProto()
            partial.CopyFrom(node)
            partial.output[0] = f"{node.output[0]}.partial"
            replaced[id(node)] = partial
            extra_nodes[id(node)] = helper.make_node(
                all_reduce.OP_TYPE, [partial.output[0], all_reduce.WORKSPACE_INPUT], [node.output[0]],
                name=f"{node.output[0]}.all_reduce", domain=contract.OP_DOMAIN, rank=index, world_size=world)
    nodes = []
    for node in graph.node:
        nodes.append(replaced.get(id(node), node))
        if id(node) in extra_nodes:
            nodes.append(extra_nodes[id(node)])
    inputs = [_rank_kv_type(i, len(kv)) if _KV_INPUT.match(i.name) else i for i in graph.input]
    inputs.append(helper.make_tensor_value_info(all_reduce.WORKSPACE_INPUT, TensorProto.UINT8,
                                                ["tp_workspace_bytes"]))
    kv_outputs = [_rank_kv_type(o, len(kv)) for o in graph.output if o.name.startswith("kv_cache_out.")]
    if index == 0:
        outputs = [o for o in graph.output if not o.name.startswith("kv_cache_out.")] + kv_outputs
    else:  # no LM head: the last all-reduce is its output, so the rank takes part in it
        last = layers[-1].down.output[0]
        outputs = [helper.make_tensor_value_info(TP_HIDDEN, TensorProto.FLOAT, None), *kv_outputs]
        nodes.append(helper.make_node("Identity", [last], [TP_HIDDEN]))
    initializers = []
    for tensor in graph.initializer:
        if tensor.name in sliced:
            initializers.append(numpy_helper.from_array(np.ascontiguousarray(sliced[tensor.name]), tensor.name))
        else:
            initializers.append(tensor)
    keep = {contract.INPUT_IDS, contract.POSITION_IDS, contract.LOGITS_INDICES}
    # the sliced weights, and no value infos: the one graph's shapes of per-head tensors are not a rank's
    sliced_graph = helper.make_graph([], graph.name, [], [], initializer=initializers)
    return prune_graph(sliced_graph, nodes, inputs, outputs, keep)


def _rank_kv_type(value: onnx.ValueInfoProto, num_kv_heads: int) -> onnx.ValueInfoProto:
    """A pool's declared type with this rank's KV heads ([num_blocks, 2, Hkv_r, block_size, D])."""
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.type.tensor_type.shape.dim[2].dim_value = num_kv_heads
    return copy


def shard_shape(spec: ModelSpec) -> ShardShape:
    return ShardShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size, spec.intermediate_size,
                      spec.vocab_size, spec.num_layers)


def check_splittable(backend: str, build: BuildOptions, spec: ModelSpec, extras: bool) -> None:
    """Refuse, in one sentence, what the split does not handle (before any graph is read); `extras`: the engine
    has Medusa heads or an image encoder."""
    if backend != BACKEND_ORT_CPU:
        raise TensorParallelError(f"tensor-parallel ranks are built for the {BACKEND_ORT_CPU} backend, not "
                                  f"{backend}")
    if build.quantization.name not in SPLIT_SCHEMES:
        raise TensorParallelError(f"tensor parallelism splits float32 and int4-q4_1 engines only; this one has "
                                  f"{build.quantization.name} weights (build it with --quantization none or int4-q4_1)")
    if build.kv_dtype == "int8":
        raise TensorParallelError("tensor parallelism does not split int8 KV pools (their per-head scales); use a "
                                  "float16 or float32 KV cache")
    if build.pipeline_stages > 1:
        raise TensorParallelError("an engine is split into pipeline stages or tensor-parallel ranks, not both")
    if extras:
        raise TensorParallelError("tensor parallelism does not split engines with Medusa heads or an image encoder")
    if spec.num_experts:
        raise TensorParallelError("tensor parallelism does not split mixture-of-experts MLPs")
    plan_ranks(shard_shape(spec), build.tensor_parallel)


def split_into_ranks(engine_dir: Path, spec: ModelSpec, count: int, say) -> tuple[TensorRank, ...]:
    """Replace engine_dir's model.onnx (+ .data) by `count` rank graphs (none for count 1; check_splittable
    first); the ranks."""
    if count == 1:
        return ()
    shape = shard_shape(spec)
    ranks = plan_ranks(shape, count)
    graph = engine_dir / "model.onnx"
    split_tensor_parallel_graph(graph, engine_dir, ranks, shape)
    for rank in ranks:
        size = (engine_dir / f"{rank.graph}.data").stat().st_size
        say(f"  {rank.graph}: heads {rank.first_head}..{rank.end_head - 1}, KV heads {rank.first_kv_head}.."
            f"{rank.end_kv_head - 1}, MLP columns {rank.first_column}..{rank.end_column - 1}, "
            f"{size / 2**20:.1f} MiB of weights")
    graph.unlink()
    (engine_dir / "model.onnx.data").unlink(missing_ok=True)
    return ranks


def split_engine_tensor_parallel(engine_dir: Path, out_dir: Path, count: int) -> Manifest:
    """A tensor-parallel copy of a one-graph engine: its graph split into `count` ranks, its other files copied,
    and its manifest with the ranks (what `kiln build --tensor-parallel` writes, without rebuilding)."""
    engine_dir, out_dir = Path(engine_dir), Path(out_dir)
    manifest = read_manifest(engine_dir)
    if manifest.ranks:
        raise TensorParallelError(f"{engine_dir} is already split into {len(manifest.ranks)} tensor-parallel ranks")
    if count < 2:
        raise TensorParallelError(f"a tensor-parallel split needs at least 2 ranks, got {count}")
    build = dataclasses.replace(manifest.build, tensor_parallel=count)
    check_splittable(manifest.backend, build, manifest.spec, manifest.medusa is not None or manifest.vision is not None)
    out_dir.mkdir(parents=True)
    for name in manifest.files:
        if not name.startswith("model.onnx"):
            shutil.copy2(engine_dir / name, out_dir / name)
    shape = shard_shape(manifest.spec)
    ranks = plan_ranks(shape, count)
    split_tensor_parallel_graph(engine_dir / "model.onnx", out_dir, ranks, shape)
    return write_manifest(out_dir, dataclasses.replace(manifest, build=build, ranks=ranks, files={}))
