"""optimize/fuse_swiglu.py on hand-built MLP activations: each silu form and operand order fuses and computes
the same values in onnxruntime; Splits that are not two halves of the last axis, or whose outputs have other
readers, and activations that are not silu, stay as they are. (On whole exported graphs: test_optimize_passes.)"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from op_library import op_library_or_skip

from kiln.contract import OP_DOMAIN
from kiln.optimize.fuse_swiglu import fuse_swiglu
from kiln.swiglu import OP_TYPE

LIBRARY = op_library_or_skip()
F = 6


def activation_graph(silu: str = "Sigmoid", swap: bool = False, sizes: list[int] | None = (F, F), axis: int = -1,
                     alpha: float | None = None, extra_reader: str | None = None) -> ir.Model:
    """y = silu(gate) * up after Split(x [T, 2F]); `extra_reader` names a value that is also a graph output."""
    nodes = [helper.make_node("Split", ["x"] + (["sizes"] if sizes else []), ["gate", "up"], axis=axis)]
    attrs = {} if alpha is None else {"alpha": alpha}
    if silu == "Sigmoid":
        nodes += [helper.make_node("Sigmoid", ["gate"], ["sig"]),
                  helper.make_node("Mul", ["sig", "gate"] if swap else ["gate", "sig"], ["silu"])]
    elif silu == "QuickGelu":
        nodes.append(helper.make_node("QuickGelu", ["gate"], ["silu"], domain="com.microsoft", **attrs))
    else:
        nodes.append(helper.make_node("Swish", ["gate"], ["silu"], **attrs))
    nodes.append(helper.make_node("Mul", ["up", "silu"] if swap else ["silu", "up"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", F])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info(extra_reader, TensorProto.FLOAT, None))
    inits = [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")] if sizes else []
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 2 * F])],
                              outputs, inits)
    opsets = [helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return ir.from_proto(model)


def run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("silu, alpha", [("Sigmoid", None), ("QuickGelu", 1.0), ("Swish", None), ("Swish", 1.0)])
@pytest.mark.parametrize("swap", [False, True])
def test_each_silu_form_fuses(silu, alpha, swap):
    before, after = activation_graph(silu, swap, alpha=alpha), activation_graph(silu, swap, alpha=alpha)
    assert fuse_swiglu(after) == 1
    assert [(n.domain, n.op_type) for n in after.graph] == [(OP_DOMAIN, OP_TYPE)]
    assert after.graph.outputs[0].name == "y" and after.opset_imports[OP_DOMAIN] == 1
    x = (np.random.default_rng(0).standard_normal((5, 2 * F)) * 3).astype(np.float32)
    np.testing.assert_allclose(run(after, x), run(before, x), rtol=1e-5, atol=1e-6)


def test_split_without_sizes_fuses_for_a_static_even_width():
    model = activation_graph(sizes=None)  # opset 18+: even parts when no sizes are given
    assert fuse_swiglu(model) == 1


@pytest.mark.parametrize("kwargs", [
    {"sizes": [F - 2, F + 2]},  # not halves
    {"axis": 0},  # not the last axis
    {"silu": "QuickGelu"},  # alpha 1.702 (its default): a GELU approximation, not silu
    {"silu": "QuickGelu", "alpha": 1.702},
    {"silu": "Swish", "alpha": 2.0},
    {"extra_reader": "gate"},  # the gate half is read elsewhere
    {"extra_reader": "up"},
    {"extra_reader": "silu"},
])
def test_does_not_fire(kwargs):
    model = activation_graph(**kwargs)
    ops = [n.op_type for n in model.graph]
    assert fuse_swiglu(model) == 0
    assert [n.op_type for n in model.graph] == ops
