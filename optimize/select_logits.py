"""Run the LM head only on the rows that need logits.

Adds the graph input ``logits_indices int64 [num_logits]`` and a Gather of those rows of the
hidden states [1, T, D], squeezed to [num_logits, D], before the final norm: before the per-row
computation that reads one activation and ends at the LM head's input (an RMSNorm as the export
writes it, x * 1/sqrt(mean(x^2, last axis) + eps) * weight, or one fused norm op), else just before
the LM head; the output becomes ``logits [num_logits, V]`` (a final logit soft-cap after the head, Gemma's, stays
after it). Backend-neutral: it runs before the backends' norm fusions (optimize/lower_onnxruntime.py), which
then fuse the final norm on [L, D].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from kiln import contract
from kiln.optimize._common import const_ints, soft_cap_input

# Ops that compute each row from that row alone (with constant operands of rank <= 1, which broadcast
# the same over [1, T, D] and [L, D]); a ReduceMean only over the last axis.
_ELEMENTWISE = ("Mul", "Div", "Add", "Sub", "Pow", "Sqrt", "Reciprocal", "Cast")
_NORM_OPS = ("SimplifiedLayerNormalization", "RMSNormalization")
_MAX_REGION = 16  # nodes: a norm is about eight; a bound keeps the search from walking the residual chain


def select_logits(model: ir.Model) -> int:
    """Returns 1 once applied, 0 when the graph's first output is not a MatMul (LM head), soft-capped or not."""
    graph = model.graph
    logits = graph.outputs[0]
    head = (soft_cap_input(logits) or logits).producer()
    if head is None or head.op_type not in ("MatMul", "Gemm"):
        return 0
    hidden, readers = per_row_input(head.inputs[0])
    if not readers:  # no per-row computation before the head: gather its input
        hidden, readers = head.inputs[0], [(head, 0)]
    indices = ir.Value(
        name=contract.LOGITS_INDICES, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["num_logits"])
    )
    graph.inputs.append(indices)
    gather = ir.node("Gather", [hidden, indices], attributes={"axis": 1})
    # [1, L, D] -> [L, D] before the norm and the head, not after: squeezing the logits output would copy
    # L x V floats every step (ONNX Runtime copies into a graph output; 0.5 ms at 32 rows of SmolLM2),
    # the hidden rows are 85x smaller, and an intermediate's Squeeze is a view.
    axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0], dtype=np.int64))})
    squeeze = ir.node("Squeeze", [gather.outputs[0], axes.outputs[0]])
    graph.insert_before(min((node for node, _ in readers), key=_position(graph)), [gather, axes, squeeze])
    for node, slot in readers:
        node.replace_input_with(slot, squeeze.outputs[0])
    gather.outputs[0].type = squeeze.outputs[0].type = hidden.type
    width = hidden.shape[-1] if hidden.shape is not None else "hidden"
    vocab = logits.shape[-1] if logits.shape is not None else "vocab"
    gather.outputs[0].shape = ir.Shape([1, "num_logits", width])
    squeeze.outputs[0].shape = ir.Shape(["num_logits", width])
    _restate_rows(head.inputs[0], squeeze.outputs[0])
    logits.name = contract.LOGITS
    logits.shape = ir.Shape(["num_logits", vocab])
    if head.outputs[0] is not logits:  # the soft-cap's values are [L, V] too
        head.outputs[0].shape = ir.Shape(["num_logits", vocab])
        _restate_rows(logits, head.outputs[0])
    return 1


def per_row_input(out: ir.Value) -> tuple[ir.Value, list[tuple[ir.Node, int]]]:
    """(x, the (node, input slot) pairs reading it) for the largest per-row computation of one activation x
    that produces `out` and is read only through out; (out, []) when out's producer is not per-row."""
    best: tuple[ir.Value, list[tuple[ir.Node, int]]] = (out, [])
    frontier, seen = [out], {id(out)}
    while frontier:
        value = frontier.pop(0)
        region = _region(out, value)
        if region is not None and len(region[1]) > len(best[1]):
            best = (value, region[1])
        node = value.producer()
        if node is None or not _is_per_row(node):
            continue
        for source in node.inputs:
            if source is not None and not _is_constant(source) and id(source) not in seen:
                seen.add(id(source))
                frontier.append(source)
    return best


def _region(out: ir.Value, x: ir.Value) -> tuple[list[ir.Node], list[tuple[ir.Node, int]]] | None:
    """The per-row nodes between x and out, and their reads of x, when every path back from out reaches x
    (or a constant) through per-row nodes whose outputs nothing outside reads; else None."""
    if x is out:
        return None
    nodes: dict[int, ir.Node] = {}
    reads: list[tuple[ir.Node, int]] = []
    stack = [out]
    while stack:
        node = stack.pop().producer()
        if node is None or not _is_per_row(node) or len(nodes) >= _MAX_REGION:
            return None
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        for slot, source in enumerate(node.inputs):
            if source is x:
                reads.append((node, slot))
            elif source is not None and not _is_constant(source):
                stack.append(source)
    for node in nodes.values():  # nothing outside the region may read its intermediate rows
        for output in node.outputs:
            if output is out:
                continue
            if output.is_graph_output() or any(id(use.node) not in nodes for use in output.uses()):
                return None
    return list(nodes.values()), reads


def _is_per_row(node: ir.Node) -> bool:
    if node.domain not in ("", "ai.onnx", "com.microsoft") or len(node.outputs) != 1:
        return False
    if node.op_type in _NORM_OPS:
        return node.attributes.get_int("axis", -1) == -1
    if node.op_type == "ReduceMean":
        axes = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is None and "axes" in node.attributes:
            axes = list(node.attributes["axes"].as_ints())
        return axes == [-1] and node.attributes.get_int("keepdims", 1) == 1
    if node.op_type not in _ELEMENTWISE:
        return False
    return all(not _is_constant(v) or v.shape is None or len(v.shape) <= 1 for v in node.inputs if v is not None)


def _is_constant(value: ir.Value) -> bool:
    return value.const_value is not None or (value.producer() is not None and value.producer().op_type == "Constant")


def _position(graph: ir.Graph) -> Callable[[ir.Node], int]:
    order = {id(node): i for i, node in enumerate(graph)}
    return lambda node: order[id(node)]


def _restate_rows(out: ir.Value, rows: ir.Value) -> None:
    """The per-row values between the squeezed rows and out are [L, ...] now, not [1, T, ...]."""
    stack = [out]
    while stack:
        value = stack.pop()
        if value is rows or value.producer() is None or _is_constant(value):
            continue
        if value.shape is not None and len(value.shape) == 3:
            value.shape = ir.Shape(["num_logits", value.shape[-1]])
        stack.extend(v for v in value.producer().inputs if v is not None)
