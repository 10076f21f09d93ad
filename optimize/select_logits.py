"""Run the LM head only on the rows that need logits.

Adds the graph input ``logits_indices int64 [num_logits]`` and a Gather of those rows of the
hidden states [1, T, D] just before the final norm (or, when the LM head's input is not a
fused norm, just before the LM head); the output becomes ``logits [num_logits, V]``.
Run after fuse_rmsnorm (it recognises the final norm as SimplifiedLayerNormalization).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln import contract

_PER_ROW_OPS = ("SimplifiedLayerNormalization", "RMSNormalization")


def select_logits(model: ir.Model) -> int:
    """Returns 1 once applied, 0 when the graph's first output is not a MatMul (LM head)."""
    graph = model.graph
    logits = graph.outputs[0]
    head = logits.producer()
    if head is None or head.op_type not in ("MatMul", "Gemm"):
        return 0
    hidden_user, slot = head, 0
    norm = head.inputs[0].producer()
    if norm is not None and norm.op_type in _PER_ROW_OPS and len(norm.outputs) == 1:
        hidden_user = norm
    hidden = hidden_user.inputs[slot]

    indices = ir.Value(
        name=contract.LOGITS_INDICES, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["num_logits"])
    )
    graph.inputs.append(indices)
    gather = ir.node("Gather", [hidden, indices], attributes={"axis": 1})
    graph.insert_before(hidden_user, gather)
    hidden_user.replace_input_with(slot, gather.outputs[0])
    # the rows are num_logits now, not T: restate the shapes between the Gather and the output
    rows = ir.SymbolicDim("num_logits")
    for value in {gather.outputs[0], head.inputs[0], logits}:
        if value.shape is not None and len(value.shape) == 3:
            value.shape = ir.Shape([value.shape[0], rows, value.shape[2]])
        else:
            value.shape = None
    gather.outputs[0].type = hidden.type

    logits.name = f"{contract.LOGITS}_3d"
    axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0], dtype=np.int64))})
    squeeze = ir.node("Squeeze", [logits, axes.outputs[0]])
    graph.insert_after(head, [axes, squeeze])
    out = squeeze.outputs[0]
    out.name = contract.LOGITS
    out.type = ir.TensorType(ir.DataType.FLOAT)
    vocab = logits.shape[-1] if logits.shape is not None else "vocab"
    out.shape = ir.Shape(["num_logits", vocab])
    graph.outputs[0] = out
    return 1
