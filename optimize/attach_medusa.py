"""Compile Medusa heads (kiln/medusa.py) into the engine graph.

Runs on the graph lowered for ONNX Runtime (select_logits made the final norm read the rows Gather(hidden,
logits_indices) as [L, D], fuse_rmsnorm made it one op, and the LM head reads it) and before quantization, so
the heads' linear and the shared LM head are quantized like every other linear. Adds the input ``medusa_indices int64
[num_medusa]`` (rows of the packed batch, like logits_indices) and the output ``medusa_logits float32
[num_medusa, K, V]``:

    rows    = Concat(logits_indices, medusa_indices)         one Gather, one final norm for both
    x_l|x_m = Split(norm(Gather(hidden, rows) as [L+M, D]), [L, M])
    y       = x_m[:, None] + SiLU(x_m @ W + b)               W [D, K*D]: the K heads' linears, fused
    out     = LM_head(Concat(x_l, y as [M*K, D]))             one read of the head for L + M*K rows
    logits, medusa_logits = Split(out, [L, M*K]) as [L, V] and [M, K, V]

The LM head is the largest matmul of a small model and memory-bound at decode, so its weights are read
once for the logits and every head's rows together; with M = 0 (no speculation this step) the graph
costs what it did without heads (docs/design.md, "Medusa heads").
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln import contract
from kiln.optimize.quant.graph import initializer

_NORMS = ("SimplifiedLayerNormalization", "RMSNormalization")


class MedusaGraphError(ValueError):
    """The graph does not have the shape attach_medusa expects (select_logits' output)."""


def attach_medusa(model: ir.Model, weights: np.ndarray, biases: np.ndarray) -> int:
    """Add K heads (weights [K, D, D] in nn.Linear orientation, biases [K, D]); returns K."""
    graph = model.graph
    num_heads, hidden = int(weights.shape[0]), int(weights.shape[1])
    head, norm, gather = _logits_chain(graph)
    vocab = graph.outputs[0].shape[-1] if graph.outputs[0].shape is not None else None
    if not isinstance(vocab, int):
        raise MedusaGraphError("the graph's logits have no static vocabulary size")
    const = _Constants(model, num_heads, hidden, vocab)
    num_l, num_m, sizes, split_x = _gather_medusa_rows(graph, gather, norm)
    x_l, x_m = split_x.outputs
    w = initializer(model, "medusa.weight", np.ascontiguousarray(weights.transpose(2, 0, 1).reshape(hidden, -1)))
    b = initializer(model, "medusa.bias", np.ascontiguousarray(biases.reshape(-1)))
    matmul = ir.node("MatMul", [x_m, w], name="medusa.linear")
    add = ir.node("Add", [matmul.outputs[0], b])
    sigmoid = ir.node("Sigmoid", [add.outputs[0]])
    silu = ir.node("Mul", [add.outputs[0], sigmoid.outputs[0]])
    per_head = ir.node("Reshape", [silu.outputs[0], const.heads_shape])  # [M, K, D]
    x_m3 = ir.node("Unsqueeze", [x_m, const.axis1])  # [M, 1, D]
    residual = ir.node("Add", [x_m3.outputs[0], per_head.outputs[0]])
    flat = ir.node("Reshape", [residual.outputs[0], const.rows_shape])  # [M*K, D]
    head_input = ir.node("Concat", [x_l, flat.outputs[0]], attributes={"axis": 0})
    graph.insert_after(split_x, [matmul, add, sigmoid, silu, per_head, x_m3, residual, flat, head_input])
    head.replace_input_with(0, head_input.outputs[0])

    num_mk = ir.node("Mul", [num_m.outputs[0], const.k])
    out_sizes = ir.node("Concat", [num_l.outputs[0], num_mk.outputs[0]], attributes={"axis": 0})
    split_out = ir.node("Split", [head.outputs[0], out_sizes.outputs[0]], attributes={"axis": 0}, num_outputs=2)
    medusa = ir.node("Reshape", [split_out.outputs[1], const.logits_shape])
    graph.insert_after(head, [num_mk, out_sizes, split_out, medusa])
    head.outputs[0].name = f"{contract.LOGITS}_and_heads"
    split_out.outputs[0].name = contract.LOGITS
    graph.outputs[0] = split_out.outputs[0]

    _restate_shapes(gather, head, split_x, split_out, hidden, vocab)
    out = medusa.outputs[0]
    out.name = contract.MEDUSA_LOGITS
    out.type = ir.TensorType(ir.DataType.FLOAT)
    out.shape = ir.Shape(["num_medusa", num_heads, vocab])
    graph.outputs.insert(1, out)  # after logits, before the KV pools
    return num_heads


def attach_hidden(model: ir.Model) -> None:
    """For hydra heads (kiln/medusa.py): the output ``medusa_hidden float32 [num_medusa, D]``, the final
    norm's output at medusa_indices, gathered and normed with the logits rows; the LM head reads only those."""
    graph = model.graph
    head, norm, gather = _logits_chain(graph)
    hidden = head.inputs[1].shape[0] if head.inputs[1] is not None and head.inputs[1].shape is not None else None
    if not isinstance(hidden, int):
        raise MedusaGraphError("the graph's LM head has no static hidden size")
    _, _, _, split_x = _gather_medusa_rows(graph, gather, norm)
    x_l, x_m = split_x.outputs
    head.replace_input_with(0, x_l)
    _restate_rows(gather, split_x, hidden)
    out = x_m
    out.name = contract.MEDUSA_HIDDEN
    out.type = ir.TensorType(ir.DataType.FLOAT)
    graph.outputs.insert(1, out)


def _gather_medusa_rows(graph: ir.Graph, gather: ir.Node, norm: ir.Node) -> tuple[ir.Node, ir.Node, ir.Node, ir.Node]:
    """Add the medusa_indices input; the logits' Gather and final norm then run on logits_indices and
    medusa_indices together. Returns (Shape of L, Shape of M, [L, M], the Split of the norm's output)."""
    medusa_indices = ir.Value(name=contract.MEDUSA_INDICES, type=ir.TensorType(ir.DataType.INT64),
                              shape=ir.Shape(["num_medusa"]))
    logits_indices = gather.inputs[1]
    graph.inputs.insert(list(graph.inputs).index(logits_indices) + 1, medusa_indices)
    rows = ir.node("Concat", [logits_indices, medusa_indices], attributes={"axis": 0})
    graph.insert_before(gather, rows)
    gather.replace_input_with(1, rows.outputs[0])
    num_l = ir.node("Shape", [logits_indices])
    num_m = ir.node("Shape", [medusa_indices])
    sizes = ir.node("Concat", [num_l.outputs[0], num_m.outputs[0]], attributes={"axis": 0})
    split_x = ir.node("Split", [norm.outputs[0], sizes.outputs[0]], attributes={"axis": 0}, num_outputs=2)
    graph.insert_after(norm, [num_l, num_m, sizes, split_x])
    return num_l, num_m, sizes, split_x


class _Constants:
    def __init__(self, model: ir.Model, num_heads: int, hidden: int, vocab: int) -> None:
        self.heads_shape = initializer(model, "medusa.heads_shape", np.array([-1, num_heads, hidden], np.int64))
        self.rows_shape = initializer(model, "medusa.rows_shape", np.array([-1, hidden], np.int64))
        self.logits_shape = initializer(model, "medusa.logits_shape", np.array([-1, num_heads, vocab], np.int64))
        self.axis1 = initializer(model, "medusa.axis1", np.array([1], np.int64))
        self.k = initializer(model, "medusa.num_heads", np.array([num_heads], np.int64))


def _logits_chain(graph: ir.Graph) -> tuple[ir.Node, ir.Node, ir.Node]:
    """(LM head MatMul, final norm, Gather of logits_indices) behind the logits output, the norm reading the
    Gather's rows squeezed to [L, D]."""
    logits = graph.outputs[0]
    head = logits.producer()
    norm = head.inputs[0].producer() if head is not None and head.op_type == "MatMul" else None
    squeeze = norm.inputs[0].producer() if norm is not None and norm.op_type in _NORMS else None
    gather = squeeze.inputs[0].producer() if squeeze is not None and squeeze.op_type == "Squeeze" else None
    if logits.name != contract.LOGITS or gather is None or gather.op_type != "Gather" \
            or gather.inputs[1] is None or gather.inputs[1].name != contract.LOGITS_INDICES:
        raise MedusaGraphError("the graph's logits are not LM head(final norm(Gather(hidden, logits_indices))); "
                               "Medusa heads attach to what select_logits builds")
    return head, norm, gather


def _restate_rows(gather: ir.Node, split_x: ir.Node, hidden: int) -> None:
    """The gathered rows are symbolic: L + M, split into L and M after the final norm."""
    gather.outputs[0].shape = ir.Shape([1, "num_logits_and_medusa", hidden])
    split_x.inputs[0].shape = ir.Shape(["num_logits_and_medusa", hidden])  # the final norm's output
    split_x.outputs[0].shape = ir.Shape(["num_logits", hidden])
    split_x.outputs[1].shape = ir.Shape(["num_medusa", hidden])
    for value in split_x.outputs:
        value.type = split_x.inputs[0].type


def _restate_shapes(gather: ir.Node, head: ir.Node, split_x: ir.Node, split_out: ir.Node, hidden: int,
                    vocab: int) -> None:
    """Rows between the Gather and the outputs are symbolic: L + M, L, M, L + M*K."""
    _restate_rows(gather, split_x, hidden)
    head.outputs[0].shape = ir.Shape(["num_logits_and_heads", vocab])
    split_out.outputs[0].shape = ir.Shape(["num_logits", vocab])
    split_out.outputs[1].shape = ir.Shape(["num_medusa_heads", vocab])
    for value in split_out.outputs:
        value.type = head.outputs[0].type
