"""Linears reading one input -> one MatMul over the concatenated weight, then a Split.

    y_i = x @ W_i (+ b_i)   for i in 1..n, W_i a constant [K, N_i]
 -> y = x @ concat(W_1..W_n) (+ concat(b_1..b_n));  y_1..y_n = Split(y, [N_1..N_n], axis=-1)

Per layer that is q/k/v (one fused QKV projection) and gate/up (one fused gate/up projection):
one weight read and one kernel call instead of three and two. Every quantization scheme is per
output row (int8 per channel, int4 and Q4_1 groups along K), so quantizing the concatenated
matrix gives the same rows as quantizing each part. A constant [N_i] bias Add that is the
MatMul's only reader is concatenated too (zeros for the parts without one), so the quantization
passes still fold it into their kernel. Run after the passes that match MatMul outputs by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.export.lazy_initializers import MatrixRows
from kiln.optimize.quant.graph import MODULES_KEY, initializer, linear_modules, onnx_opset, unique_name


@dataclass(frozen=True)
class _Part:
    matmul: ir.Node
    weight: ir.TensorProtocol  # float32 [K, N_i], the MatMul's orientation (lazy in a build: not read here)
    bias_add: ir.Node | None
    bias: np.ndarray | None  # float32 [N_i]

    @property
    def k(self) -> int:
        return int(self.weight.shape[0])

    @property
    def n(self) -> int:
        return int(self.weight.shape[1])

    @property
    def output(self) -> ir.Value:
        """The value the fused graph must still produce: the bias Add's output if folded."""
        return (self.bias_add or self.matmul).outputs[0]


def fuse_projections(model: ir.Model) -> int:
    """Fuse every group of two or more constant-weight MatMuls sharing an input; returns how many groups."""
    groups: dict[int, list[_Part]] = {}
    for node in model.graph:
        part = _as_part(node)
        if part is not None:
            groups.setdefault(id(node.inputs[0]), []).append(part)
    fused = 0
    for parts in groups.values():
        by_k: dict[int, list[_Part]] = {}
        for part in parts:
            by_k.setdefault(part.k, []).append(part)
        for same_k in by_k.values():
            if len(same_k) >= 2:
                _fuse(model, same_k)
                fused += 1
    return fused


def _is_default(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _float_const(value: ir.Value | None, rank: int) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    array = value.const_value.numpy()
    return array if array.ndim == rank and array.dtype == np.float32 else None


def _as_part(node: ir.Node) -> _Part | None:
    """node as a fusable linear: a MatMul of an activation by a constant [K, N] float32 initializer."""
    if not _is_default(node, "MatMul") or node.inputs[0] is None or node.inputs[0].const_value is not None:
        return None
    weight = node.inputs[1].const_value if node.inputs[1] is not None else None
    if weight is None or weight.dtype != ir.DataType.FLOAT or len(weight.shape) != 2:
        return None
    if node.outputs[0].is_graph_output():
        return None
    bias_add, bias = _bias_of(node.outputs[0], int(weight.shape[1]))
    return _Part(node, weight, bias_add, bias)


def _bias_of(out: ir.Value, n: int) -> tuple[ir.Node | None, np.ndarray | None]:
    """The Add of a constant [n] bias when it is out's only reader, else (None, None)."""
    uses = list(out.uses())
    if len(uses) != 1 or not _is_default(uses[0].node, "Add"):
        return None, None
    add = uses[0].node
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    bias = _float_const(other, rank=1)
    return (add, bias) if bias is not None and bias.shape == (n,) else (None, None)


def _fuse(model: ir.Model, parts: list[_Part]) -> None:
    """One MatMul (+ bias Add) over the concatenated weight, split back into the parts' outputs."""
    first = parts[0].matmul
    prefix = f"{first.inputs[1].name}.fused"  # initializer names: unique, the first part's weight + suffix
    weight = _concatenated(model, prefix, [p.weight for p in parts])
    matmul = ir.node("MatMul", [first.inputs[0], weight], name=f"{first.name}.fused")
    modules = [m for p in parts for m in linear_modules(p.matmul)]
    if modules:  # the quantization passes find a linear by module name (int8 fallback)
        matmul.metadata_props[MODULES_KEY] = ",".join(modules)
    nodes, fused = [matmul], matmul.outputs[0]
    if any(p.bias is not None for p in parts):
        biases = [p.bias if p.bias is not None else np.zeros(p.n, np.float32) for p in parts]
        add = ir.node("Add", [fused, initializer(model, f"{prefix}.bias", np.concatenate(biases))])
        nodes, fused = [*nodes, add], add.outputs[0]
    sizes = np.array([p.n for p in parts], np.int64)
    outputs = [p.output for p in parts]
    split = _split(model, fused, sizes, f"{prefix}.split")
    for node in nodes:  # the fused [..., sum N_i] keeps the parts' dtype and leading dims
        node.outputs[0].type = outputs[0].type
        node.outputs[0].shape = _widened(outputs[0].shape, int(sizes.sum()))
    old_nodes = [n for p in parts for n in (p.matmul, p.bias_add) if n is not None]
    ir.convenience.replace_nodes_and_values(model.graph, first, old_nodes, [*nodes, split], outputs,
                                            list(split.outputs))


def _concatenated(model: ir.Model, name: str, weights: list[ir.TensorProtocol]) -> ir.Value:
    """An initializer holding the weights side by side [K, sum N_i], computed when read, one part at a time into
    the result (never the whole model's weights; a build's parts are lazy). Over checkpoint matrices the result
    is MatrixRows too, so a quantizer reads the fused W [sum N_i, K] without a transposed copy."""
    k, sizes = int(weights[0].shape[0]), [int(w.shape[1]) for w in weights]
    shape = ir.Shape([k, sum(sizes)])
    value = ir.Value(name=name, shape=shape, type=ir.TensorType(ir.DataType.FLOAT))
    unique_name(model, value)
    bounds = np.cumsum([0, *sizes])
    if all(isinstance(w, MatrixRows) for w in weights):
        def stacked_rows() -> np.ndarray:
            out = np.empty((int(bounds[-1]), k), np.float32)
            for w, start, end in zip(weights, bounds[:-1], bounds[1:], strict=True):
                out[start:end] = w.rows()  # type: ignore[attr-defined]
            return out
        parts = [w.blocks for w in weights]  # type: ignore[attr-defined]
        blocks = tuple(b for part in parts for b in part) if all(parts) else ()
        value.const_value = MatrixRows(stacked_rows, int(bounds[-1]), k, name=value.name, blocks=blocks)
    else:
        def side_by_side() -> ir.TensorProtocol:
            out = np.empty((k, int(bounds[-1])), np.float32)
            for w, start, end in zip(weights, bounds[:-1], bounds[1:], strict=True):
                out[:, start:end] = w.numpy()
            return ir.tensor(out)
        value.const_value = ir.LazyTensor(side_by_side, ir.DataType.FLOAT, shape, name=value.name)
    model.graph.register_initializer(value)
    return value


def _split(model: ir.Model, fused: ir.Value, sizes: np.ndarray, name: str) -> ir.Node:
    """Split along the last axis into sizes (the sizes an input from opset 13 on, an attribute before)."""
    if onnx_opset(model) >= 13:
        return ir.node("Split", [fused, initializer(model, name, sizes)], attributes={"axis": -1},
                       num_outputs=len(sizes))
    return ir.node("Split", [fused], attributes={"axis": -1, "split": sizes.tolist()}, num_outputs=len(sizes))


def _widened(shape: ir.Shape | None, last: int) -> ir.Shape | None:
    return None if shape is None or len(shape) == 0 else ir.Shape([*list(shape)[:-1], last])
