"""Flatten the traced [1, T] token inputs to the contract's [T] (Unsqueeze inside the graph)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln import contract


def flatten_inputs(model: ir.Model, names=(contract.INPUT_IDS, contract.POSITION_IDS)) -> int:
    """Replace each named [1, T] graph input by a [T] input; returns how many were flattened."""
    graph = model.graph
    count = 0
    for name in names:
        index = next((i for i, v in enumerate(graph.inputs) if v.name == name), None)
        if index is None:
            continue
        old = graph.inputs[index]
        if old.shape is None or len(old.shape) != 2 or old.shape[0] != 1:
            continue
        old.name = f"{name}_2d"
        new = ir.Value(name=name, type=old.type, shape=ir.Shape([old.shape[1]]))
        axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0], dtype=np.int64))})
        unsqueeze = ir.node("Unsqueeze", [new, axes.outputs[0]])
        first = next(iter(graph))
        graph.insert_before(first, [axes, unsqueeze])
        old.replace_all_uses_with(unsqueeze.outputs[0])
        unsqueeze.outputs[0].name = old.name
        unsqueeze.outputs[0].shape = old.shape
        unsqueeze.outputs[0].type = old.type
        graph.inputs[index] = new
        count += 1
    return count
