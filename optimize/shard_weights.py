"""The weights of a linear node of a finished graph, sliced for a tensor-parallel rank (shard_tensor_parallel.py).

Two kinds of linear are split: a float32 `MatMul(x, W)` with W [K, N], and `kiln.MatMulQ4_1(x, qs, dm)`
(kiln/matmul_q4_1.py: N output channels of Q4_1 blocks of 32 along K, in blocks or in the kernel's records).
Columns (output channels) are rows of blocks' qs and dm; an input range [k0, k1) must start and end on a block
(multiples of 32), and is cut from the unpacked nibbles and repacked, since qs pairs blocks 2j and 2j + 1 in one
byte. Records hold 16 channels a record, so both cuts unpack them and pack the slice as records again: a rank keeps
its graph's layout. A rank's activations quantize per block of 32 as the one graph's do, so a rank's partial sum is
the one graph's sum over its blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from kiln import contract
from kiln.matmul_q4_1 import BLOCK, BLOCKS, Q4_1Weights, node_layout
from kiln.matmul_q4_1 import OP_TYPE as MATMUL_Q4_1
from kiln.tensor_parallel import TensorParallelError


class WeightReader:
    """The arrays of a graph's initializers, read from its external data on demand."""

    def __init__(self, graph: onnx.GraphProto, source_dir: Path) -> None:
        self.tensors = {t.name: t for t in graph.initializer}
        self.source_dir = source_dir

    def array(self, name: str) -> np.ndarray:
        tensor = onnx.TensorProto()
        tensor.CopyFrom(self.tensors[name])
        if tensor.data_location == TensorProto.EXTERNAL:
            onnx.external_data_helper.load_external_data_for_tensor(tensor, str(self.source_dir))
            tensor.data_location = TensorProto.DEFAULT
            del tensor.external_data[:]
        array: np.ndarray = numpy_helper.to_array(tensor)
        return array


def is_linear(node: onnx.NodeProto, initializers: set[str]) -> bool:
    """A MatMul with a constant float weight, or a kiln.MatMulQ4_1 with constant blocks and no bias."""
    if node.op_type == "MatMul" and not node.domain:
        return node.input[1] in initializers
    if node.op_type == MATMUL_Q4_1 and node.domain == contract.OP_DOMAIN:
        return len(node.input) == 3 and all(name in initializers for name in node.input[1:3])
    return False


def describe(node: onnx.NodeProto | None) -> str:
    return "none" if node is None else f"{node.domain + '.' if node.domain else ''}{node.op_type}"


def column_slices(node: onnx.NodeProto, columns: np.ndarray, weights: WeightReader) -> dict[str, np.ndarray]:
    """The node's weight tensors keeping output channels `columns` (in that order)."""
    if node.op_type == "MatMul":
        return {node.input[1]: _float_matrix(weights, node.input[1])[:, columns]}
    qs, dm = node.input[1], node.input[2]
    if node_layout(node) == BLOCKS:
        return {qs: weights.array(qs)[columns], dm: weights.array(dm)[columns]}
    full = _q4_1_weights(node, weights)
    return _q4_1_inputs(node, Q4_1Weights(full.q[columns], full.d[columns], full.m[columns]))


def row_slices(node: onnx.NodeProto, rows: range, weights: WeightReader) -> dict[str, np.ndarray]:
    """The node's weight tensors keeping input channels [rows.start, rows.stop)."""
    if node.op_type == "MatMul":
        return {node.input[1]: _float_matrix(weights, node.input[1])[rows.start:rows.stop, :]}
    if rows.start % BLOCK or rows.stop % BLOCK:
        raise TensorParallelError(f"{node.name or node.output[0]}'s input channels {rows.start}..{rows.stop - 1} do "
                                  f"not start and end on Q4_1 blocks of {BLOCK}")
    full = _q4_1_weights(node, weights)
    first, end = rows.start // BLOCK, rows.stop // BLOCK
    part = Q4_1Weights(np.ascontiguousarray(full.q[:, rows.start:rows.stop]),
                       np.ascontiguousarray(full.d[:, first:end]), np.ascontiguousarray(full.m[:, first:end]))
    return _q4_1_inputs(node, part)


def _q4_1_weights(node: onnx.NodeProto, weights: WeightReader) -> Q4_1Weights:
    return Q4_1Weights.unpack_as(node_layout(node), weights.array(node.input[1]), weights.array(node.input[2]))


def _q4_1_inputs(node: onnx.NodeProto, part: Q4_1Weights) -> dict[str, np.ndarray]:
    """The node's (qs, dm) tensors holding `part`, in the node's layout."""
    qs, dm = part.pack_as(node_layout(node))
    return {node.input[1]: qs, node.input[2]: dm}


def _float_matrix(weights: WeightReader, name: str) -> np.ndarray:
    array = weights.array(name)
    if array.dtype != np.float32 or array.ndim != 2:
        raise TensorParallelError(f"initializer {name} is {array.dtype} {list(array.shape)}, not a float32 matrix")
    return array
