"""The weight bytes one decode step reads: the denominator of `kiln bench`'s bandwidth floor.

An engine's files overstate it. A gathered table (the token embedding: Gather or GatherBlockQuantized) is read one
row per token, not whole, and a kiln.MoE node reads top_k of its E experts per token. Counting the file sizes put
a 1B GGUF engine's floor at 800 MB a token where the step reads 667 MB (its 133 MB 8-bit embedding table is
gathered), so its decode rate looked 20% closer to the floor than it is.

Reading the graph needs the `onnx` package (kiln's compile extra), so this lives on the build side: `kiln bench`
asks it where onnx is installed and otherwise counts the files (runtime/bench/offline.py), and says which it did.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
import onnx.helper

from kiln.manifest import read_manifest

if TYPE_CHECKING:
    from onnx import GraphProto, NodeProto, TensorProto

# op type -> the input position that holds indices; every other input of the node belongs to the gathered table
_GATHERS = {"Gather": 1, "GatherBlockQuantized": 1}
# kiln.MoE's expert inputs (gate_up, down and their Q4_1 scales); 0 is the activations, 1 the router
_MOE_FIRST_EXPERT_INPUT = 2


def weight_bytes_per_token(engine_dir: Path) -> int:
    """The bytes of the engine graphs' initializers one decode step reads (every stage's or rank's graph)."""
    total = 0.0
    for graph in read_manifest(engine_dir, verify_checksums=False).graph_files:
        model = onnx.load(str(Path(engine_dir) / graph), load_external_data=False)
        total += graph_bytes_per_token(model.graph)
    return round(total)


def graph_bytes_per_token(graph: GraphProto) -> float:
    """The bytes of an onnx GraphProto's initializers one token's step reads (each at the largest share any of its
    consumers reads)."""
    share: dict[str, float] = {}  # initializer -> the largest fraction of it a consumer reads
    for _, name, fraction in _initializer_reads(graph):
        share[name] = max(share.get(name, 0.0), fraction)
    return sum(_nbytes(t) * share.get(t.name, 1.0) for t in graph.initializer)


def node_bytes_per_token(graph: GraphProto) -> dict[str, float]:
    """Node name -> the initializer bytes that node reads for one token (a table shared by two nodes, such as a
    tied head, counts for each: what each node's own time is set against)."""
    sizes = {t.name: _nbytes(t) for t in graph.initializer}
    out: dict[str, float] = defaultdict(float)
    for node, name, fraction in _initializer_reads(graph):
        out[node.name] += sizes.get(name, 0) * fraction
    return dict(out)


def _initializer_reads(graph: GraphProto) -> Iterator[tuple[NodeProto, str, float]]:
    """(node, input name, the fraction of it one token's step reads) for every named input of every node."""
    for node in graph.node:
        fraction_of = _fraction_reader(node, graph)
        for position, name in enumerate(node.input):
            if name:
                yield node, name, fraction_of(position)


def _fraction_reader(node: NodeProto, graph: GraphProto) -> Callable[[int], float]:
    """position -> the fraction of that input one token's step reads."""
    if node.op_type in _GATHERS and node.domain in ("", "ai.onnx", "com.microsoft"):
        indices = _GATHERS[node.op_type]
        return lambda position: 1.0 if position == indices else 0.0
    if node.op_type == "MoE" and node.domain == "kiln":
        top_k = int(next(a.i for a in node.attribute if a.name == "top_k"))
        experts = _leading_dim(graph, node.input[1])  # the router [E, D]
        share = top_k / experts if experts else 1.0
        return lambda position: share if position >= _MOE_FIRST_EXPERT_INPUT else 1.0
    return lambda position: 1.0


def _leading_dim(graph: GraphProto, name: str) -> int | None:
    for t in graph.initializer:
        if t.name == name:
            return int(t.dims[0]) if t.dims else None
    return None


def _nbytes(tensor: TensorProto) -> int:
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    if tensor.raw_data:
        return len(tensor.raw_data)
    count = math.prod(tensor.dims)
    return int(count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize)
