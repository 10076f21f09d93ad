"""The export's weight placeholders (export/lazy_initializers.py): nothing the exporter reads by value is one.

A placeholder's bytes are whatever the allocator's memory held. The exporter's optimizer merges small initializers
with equal bytes, so two placeholders that happened to hold the same bytes became one initializer: Qwen2-MoE's second
router read the first's weight (1.13 off transformers, after other tests had run in the process).
"""

from __future__ import annotations

import numpy as np
import torch
from helpers import make_tiny_hf_model
from onnx_ir.passes.common import DeduplicateInitializersPass

from kiln.export import onnx_export
from kiln.export.checkpoint import load_checkpoint
from kiln.export.lazy_initializers import FILLED_AT_MOST, placeholder_weights


def test_matrices_the_exporter_compares_by_value_hold_their_numbers():
    assert FILLED_AT_MOST >= DeduplicateInitializersPass().size_limit
    weights = {"small": torch.arange(12.0).reshape(3, 4), "large": torch.ones(FILLED_AT_MOST + 1, 2),
               "row": torch.ones(1, 4096), "vector": torch.ones(8)}
    state, placeholders = placeholder_weights(weights)
    assert [(p.name, p.filled) for p in placeholders] == [("small", True), ("large", False)]
    assert torch.equal(state["small"], weights["small"]) and state["small"].data_ptr() != weights["small"].data_ptr()
    assert state["large"].shape == weights["large"].shape
    assert state["row"] is weights["row"] and state["vector"] is weights["vector"]


def test_equal_placeholder_bytes_do_not_merge_weights(tmp_path, monkeypatch):
    """Every placeholder zero-filled (memory that happened to hold equal bytes): each linear of a one-layer model
    still reads its own weight, with the checkpoint's numbers (merged, k/v, q/o and gate/up shared one)."""
    def zeroed_placeholders(weights):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "empty", torch.zeros)
            return placeholder_weights(weights)

    monkeypatch.setattr(onnx_export, "placeholder_weights", zeroed_placeholders)
    # [16, 16], [8, 16] and [48, 16] linears, which the exporter compares by value; the [320, 16] embedding (the
    # tied LM head) larger
    checkpoint = load_checkpoint(make_tiny_hf_model(tmp_path, num_hidden_layers=1, hidden_size=16,
                                                    intermediate_size=48))
    model = onnx_export.export_model(checkpoint)
    matrices = {name: w.numpy().T for name, w in checkpoint.weights.items() if w.ndim == 2}
    read = []
    for node in model.graph:
        weight = node.inputs[1].const_value if node.op_type == "MatMul" else None
        if weight is not None:
            values = weight.numpy()
            read += [name for name, m in matrices.items() if m.shape == values.shape and np.array_equal(m, values)]
    assert sorted(read) == sorted(matrices)
