"""optimize/quantize_moe.py: a kiln.MoE graph's float experts become Q4_1 inputs, and the quantized graph computes the
op's Q4_1 spec on them (the pass's packing is the kernel's layout); optimize/pack_q4_1_records.py then gives them as
the kernel's records, which compute the blocks' bits."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import numpy_helper

from kiln.matmul_q4_1 import LAYOUT, RECORDS
from kiln.moe import make_single_op_model, moe_q4_1_ref, q4_1_experts_to_records, unpack_q4_1_experts
from kiln.optimize.pack_q4_1_records import pack_moe_q4_1_records
from kiln.optimize.quantize_moe import moe_nodes, quantize_moe_experts

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()


def graph_with_constant_experts(rng, experts: int, d: int, f: int):
    model = make_single_op_model(top_k=2, norm_topk_prob=True)
    arrays = {"router": rng.standard_normal((experts, d)).astype(np.float32),
              "gate_up": (rng.standard_normal((experts, 2 * f, d)) / np.sqrt(d)).astype(np.float32),
              "down": (rng.standard_normal((experts, d, f)) / np.sqrt(f)).astype(np.float32)}
    keep = [value for value in model.graph.input if value.name == "x"]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in arrays.items())
    return ir.serde.deserialize_model(model), arrays


def run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    proto = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(proto, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_experts_become_q4_1_and_the_graph_computes_the_spec():
    rng = np.random.default_rng(0)
    model, arrays = graph_with_constant_experts(rng, experts=6, d=64, f=32)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    assert quantize_moe_experts(model) == 1
    (node,) = moe_nodes(model)
    assert [v.const_value.dtype for v in node.inputs[2:]] == [ir.DataType.UINT8] * 2 + [ir.DataType.FLOAT16] * 2
    assert "gate_up" not in model.graph.initializers  # the float stacks are gone
    gate_up = tuple(node.inputs[i].const_value.numpy() for i in (2, 4))
    down = tuple(node.inputs[i].const_value.numpy() for i in (3, 5))
    # 4-bit rounding of the weights, not other numbers
    assert np.abs(unpack_q4_1_experts(*gate_up) - arrays["gate_up"]).max() < 0.2
    want = moe_q4_1_ref(x, arrays["router"], gate_up, down, top_k=2, norm_topk_prob=True)
    np.testing.assert_allclose(run(model, x), want, rtol=0, atol=4e-6 * np.abs(want).max())
    assert quantize_moe_experts(model) == 0  # already converted


def test_q4_1_experts_become_records_with_the_blocks_bits():
    rng = np.random.default_rng(2)
    model, _ = graph_with_constant_experts(rng, experts=6, d=64, f=32)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    quantize_moe_experts(model)
    (node,) = moe_nodes(model)
    blocks = [node.inputs[i].const_value.numpy() for i in range(2, 6)]
    want = run(model, x)
    assert pack_moe_q4_1_records(model) == 1
    assert node.attributes[LAYOUT].as_string() == RECORDS
    for w in (0, 1):  # each stack the records of its blocks, which are gone
        records, rows = (node.inputs[2 + w + 2 * i].const_value.numpy() for i in (0, 1))
        want_records, want_rows = q4_1_experts_to_records(blocks[w], blocks[w + 2])
        np.testing.assert_array_equal(records, want_records)
        assert rows.shape == want_rows.shape
    assert not [v for v in model.graph.initializers.values() if v.const_value.dtype == ir.DataType.UINT8
                and len(v.shape) == 3]
    np.testing.assert_array_equal(run(model, x), want)
    assert pack_moe_q4_1_records(model) == 0  # already records
    float_model, _ = graph_with_constant_experts(rng, experts=6, d=64, f=32)
    assert pack_moe_q4_1_records(float_model) == 0  # float experts stay


def test_experts_not_whole_blocks_wide_stay_float():
    model, _ = graph_with_constant_experts(np.random.default_rng(1), experts=4, d=48, f=32)
    assert quantize_moe_experts(model) == 0


def test_int8_weight_only_experts_become_q8_0_gguf_experts_computing_their_spec():
    """int8-weight-only: each expert's rows are ggml's Q8_0 of its float rows (gguf-py's quantizer, bit for bit), the
    node kiln.MoE's Q8_0 GGUF experts with int8 activations, and the graph computes that spec; close to the float
    experts."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from kiln.gguf_blocks import GgmlType
    from kiln.matmul_gguf import INT8_ATTRIBUTE
    from kiln.moe import moe_ref
    from kiln.moe_gguf import TYPE_ATTRIBUTES, GgufExperts, moe_gguf_ref
    from kiln.optimize.quantize_moe import quantize_moe_experts_q8_0

    rng = np.random.default_rng(3)
    model, arrays = graph_with_constant_experts(rng, experts=6, d=64, f=32)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    assert quantize_moe_experts_q8_0(model) == 1
    (node,) = moe_nodes(model)
    assert [node.attributes[a].as_int() for a in TYPE_ATTRIBUTES] == [GgmlType.Q8_0] * 3
    assert node.attributes[INT8_ATTRIBUTE].as_int() == 1
    assert "gate_up" not in model.graph.initializers  # the float stacks are gone
    gate_up, down = (node.inputs[i].const_value.numpy() for i in (2, 3))
    for got, floats in ((gate_up, arrays["gate_up"]), (down, arrays["down"])):
        for e in range(6):  # each expert's own rows, in order
            np.testing.assert_array_equal(got[e], quantize(floats[e], GGMLQuantizationType.Q8_0))
    experts = GgufExperts(gate_up, down, GgmlType.Q8_0, GgmlType.Q8_0, GgmlType.Q8_0)
    want = moe_gguf_ref(x, arrays["router"], experts, top_k=2, norm_topk_prob=True)
    out = run(model, x)
    np.testing.assert_allclose(out, want, rtol=0, atol=4e-6 * np.abs(want).max())
    floats = moe_ref(x, arrays["router"], arrays["gate_up"], arrays["down"], top_k=2, norm_topk_prob=True)
    assert np.abs(out - floats).max() < 0.02 * np.abs(floats).max()  # 8-bit weights and activations
    assert quantize_moe_experts_q8_0(model) == 0  # already converted

