"""Run the LM head only on the rows that need logits.

Adds the graph input ``logits_indices int64 [num_logits]`` and a Gather of those rows of the
hidden states [1, T, D], squeezed to [num_logits, D], just before the final norm (or, when the LM
head's input is not a fused norm, just before the LM head); the output becomes ``logits [num_logits, V]``.
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
    # [1, L, D] -> [L, D] before the norm and the head, not after: squeezing the logits output would copy
    # L x V floats every step (ONNX Runtime copies into a graph output; 0.5 ms at 32 rows of SmolLM2),
    # the hidden rows are 85x smaller, and an intermediate's Squeeze is a view.
    axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0], dtype=np.int64))})
    squeeze = ir.node("Squeeze", [gather.outputs[0], axes.outputs[0]])
    graph.insert_before(hidden_user, [gather, axes, squeeze])
    hidden_user.replace_input_with(slot, squeeze.outputs[0])
    gather.outputs[0].type = squeeze.outputs[0].type = hidden.type
    width = hidden.shape[-1] if hidden.shape is not None else "hidden"
    vocab = logits.shape[-1] if logits.shape is not None else "vocab"
    gather.outputs[0].shape = ir.Shape([1, "num_logits", width])
    squeeze.outputs[0].shape = head.inputs[0].shape = ir.Shape(["num_logits", width])  # the norm's too
    logits.name = contract.LOGITS
    logits.shape = ir.Shape(["num_logits", vocab])
    return 1
