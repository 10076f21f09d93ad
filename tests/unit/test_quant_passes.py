"""Weight-quantization passes on a tiny ONNX graph shaped like kiln's (tied LM head included).

The reference for a quantized graph is numpy: the same network written out as ``x @ W.T`` with W
the numpy reference quantizer's (quant/rtn.py) dequantization of the original fp32 weights.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.matmul_q4_1 import matmul_q4_1_ref
from kiln.optimize.quant import rtn
from kiln.optimize.quant.graph import find_linears, initializer
from kiln.optimize.quantize_int4 import quantize_int4
from kiln.optimize.quantize_int8 import quantize_int8_weight_only
from kiln.optimize.quantize_q4_1 import quantize_q4_1_pass
from kiln.optimize.quantize_w8a8 import quantize_w8a8
from kiln.runtime.ops import library_path

V, H, F = 96, 64, 160  # vocab, hidden (not a multiple of 128: a padded last group), ffn


def tiny_graph(opset: int = 18, seed: int = 0) -> tuple[ir.Model, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    w = {
        "embed": rng.standard_normal((V, H)).astype(np.float32),
        "up": (rng.standard_normal((F, H)) / np.sqrt(H)).astype(np.float32),
        "up_bias": (0.1 * rng.standard_normal(F)).astype(np.float32),
        "down": (rng.standard_normal((H, F)) / np.sqrt(F)).astype(np.float32),
    }
    inits = [
        numpy_helper.from_array(w["embed"], "embed"),
        numpy_helper.from_array(np.ascontiguousarray(w["up"].T), "up_t"),
        numpy_helper.from_array(w["up_bias"], "up_bias"),
        numpy_helper.from_array(np.ascontiguousarray(w["down"].T), "down_t"),
    ]
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["h"]),
        helper.make_node("MatMul", ["h", "up_t"], ["u0"], name="up"),
        helper.make_node("Add", ["u0", "up_bias"], ["u"]),
        helper.make_node("Relu", ["u"], ["a"]),
        helper.make_node("MatMul", ["a", "down_t"], ["d"], name="down"),
        helper.make_node("Add", ["d", "h"], ["r"]),
        helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["r", "embed_t"], ["logits"], name="lm_head"),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["T"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", V])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return ir.from_proto(model), w


def to_proto(model: ir.Model) -> onnx.ModelProto:
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    return proto


def all_nodes(graph: onnx.GraphProto):
    """The graph's nodes and those of its subgraphs (an If's branches)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attribute.g)


def run(model: ir.Model, ids: np.ndarray, fp32_kernels: bool = False) -> np.ndarray:
    """The graph's logits in onnxruntime. fp32_kernels runs every MatMulNBits at accuracy_level 0
    (fp32 activations) instead of the shipped 4 (activations quantized to int8 in the kernel), so
    that the graph computes x @ dequant(W).T up to float rounding."""
    proto = to_proto(model)
    for node in all_nodes(proto.graph):
        if node.op_type == "MatMulNBits":
            level = next(a for a in node.attribute if a.name == "accuracy_level")
            assert level.i == 4  # what the passes ship: the fast int8 path on CPU
            if fp32_kernels:
                level.i = 0
    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())  # kiln.MatMulQ4_1
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"ids": ids})[0]


def run_all(model: ir.Model, ids: np.ndarray) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    sess = ort.InferenceSession(to_proto(model).SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"ids": ids})


IDS = np.arange(0, V, 3, dtype=np.int64)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def forward(w: dict[str, np.ndarray], up: np.ndarray, down: np.ndarray, head: np.ndarray,
            table: np.ndarray | None = None) -> np.ndarray:
    """tiny_graph's network in numpy with the given [N, K] weights (and embedding table)."""
    h = (w["embed"] if table is None else table)[IDS].astype(np.float64)
    a = np.maximum(h @ up.T + w["up_bias"], 0)
    return (a @ down.T + h) @ head.T


def per_channel(w: dict[str, np.ndarray], *names: str) -> list[np.ndarray]:
    """The named weights through the reference symmetric int8 per-channel quantizer."""
    out = []
    for name in names:
        q, scale = rtn.quantize_per_channel_int8(w[name])
        out.append(q.astype(np.float32) * scale[:, None])
    return out


def assert_computes(model: ir.Model, reference: np.ndarray) -> None:
    """The quantized graph with fp32 kernels is the reference network, to float rounding."""
    np.testing.assert_allclose(run(model, IDS, fp32_kernels=True), reference, rtol=0,
                               atol=1e-5 * np.abs(reference).max())


def test_find_linears_sees_tied_head_and_bias():
    model, w = tiny_graph()
    linears = {lin.name: lin for lin in find_linears(model)}
    assert set(linears) == {"up", "down", "lm_head"}
    assert linears["up"].bias.name == "up_bias" and linears["up"].output.name == "u"
    np.testing.assert_array_equal(linears["lm_head"].weight, w["embed"])
    assert linears["lm_head"].weight_name == "embed"


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_matches_reference_quantizer_and_runs(group):
    model, w = tiny_graph()
    fp32 = run(model, IDS)
    assert quantize_int4(model, group_size=group) == 3
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulNBits") == 3 and "MatMul" not in ops and "Transpose" not in ops
    # the Gather keeps its fp32 table; the LM head has its own int4 copy
    gather = next(n for n in model.graph if n.op_type == "Gather")
    assert gather.inputs[0].name == "embed"
    assert model.graph.initializers["embed"].const_value.dtype == ir.DataType.FLOAT
    assert "up_t" not in model.graph.initializers and "down_t" not in model.graph.initializers
    up, down = (rtn.quantize_groupwise(w[name], 4, group).dequantize() for name in ("up", "down"))
    assert rel_err(up, w["up"]) < 0.2 and rel_err(down, w["down"]) < 0.2
    # the LM head is int8 per channel unless asked for int4
    reference = forward(w, up, down, rtn.per_channel_as_groups(w["embed"], group).dequantize())
    assert rel_err(reference, fp32) > 1e-3  # int4 moves the logits far beyond the tolerance below
    assert_computes(model, reference)
    assert rel_err(run(model, IDS), reference) < 0.01  # the shipped int8-activation kernel
    assert rel_err(run(model, IDS), fp32) < 0.1


def q4_1_weights(rng, n, k):
    """What a Q4_1 GGUF dequantizes to: per block of 32, fp16 step d and minimum m, w = m + q * d."""
    d = rng.uniform(0.005, 0.05, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.4, 0.05, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 maps a block's min to 0 and its max to 15
    return (m + q * d).reshape(n, k).astype(np.float32)


def q4_1_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """kiln.MatMulQ4_1's reference on the Q4_1 quantization of w (activations as the graph has them, float32)."""
    return matmul_q4_1_ref(x.astype(np.float32), *rtn.quantize_q4_1(w).pack()).astype(np.float64)


def test_q4_1_reference_is_exact_on_q4_1_weights():
    rng = np.random.default_rng(1)
    w = q4_1_weights(rng, 48, 96)
    np.testing.assert_array_equal(rtn.quantize_q4_1(w).dequantize(), w)  # bit-exact
    other = rng.standard_normal((8, 64)).astype(np.float32)  # any weights: min/max RTN, float16 d and m
    qw = rtn.quantize_q4_1(other)
    step = np.repeat(qw.d.astype(np.float32), 32, axis=1)
    bound = step / 2 + 2.0**-11 * (np.repeat(np.abs(qw.m.astype(np.float32)), 32, axis=1) + 16 * step)
    assert np.all(np.abs(qw.dequantize() - other) <= bound)
    with pytest.raises(ValueError, match="divisible by 32"):
        rtn.quantize_q4_1(other[:, :40])


def test_q4_1_pass_runs_and_keeps_q4_1_weights():
    model, w = tiny_graph()
    rng = np.random.default_rng(2)
    w["up"], w["down"] = q4_1_weights(rng, F, H), q4_1_weights(rng, H, F)
    model.graph.initializers["up_t"].const_value = ir.tensor(np.ascontiguousarray(w["up"].T), name="up_t")
    model.graph.initializers["down_t"].const_value = ir.tensor(np.ascontiguousarray(w["down"].T), name="down_t")
    fp32 = run(model, IDS)
    assert quantize_q4_1_pass(model) == 3
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulQ4_1") == 2 and ops.count("MatMulNBits") == 1 and "MatMul" not in ops
    # the op's reference on the Q4_1 weights (int8 activations), the int8 LM head in fp32 kernels
    h = w["embed"][IDS].astype(np.float32)
    a = np.maximum(q4_1_linear(h, w["up"]) + w["up_bias"], 0)
    head = rtn.per_channel_as_groups(w["embed"], 128).dequantize()
    reference = (q4_1_linear(a, w["down"]) + h) @ head.T
    assert_computes(model, reference)
    # the Q4_1 weights come through exactly: int8 activations and the int8 head are all that differ
    np.testing.assert_allclose(rtn.quantize_q4_1(w["up"]).dequantize(), w["up"], rtol=0, atol=0)
    assert rel_err(run(model, IDS), fp32) < 0.02


def test_q4_1_records_pass_stores_the_kernel_s_layout_and_keeps_the_logits_bit_for_bit():
    """The build's last pass gives every kiln.MatMulQ4_1 (the int4 head too) its weights as the kernel's records:
    the logits are the blocks' bit for bit, the blocks' initializers go, and a second run finds nothing to do."""
    from kiln.matmul_q4_1 import RECORDS, Q4_1Weights
    from kiln.optimize.pack_q4_1_records import pack_q4_1_records

    model, w = tiny_graph()
    assert quantize_q4_1_pass(model, int4_lm_head=True) == 3
    blocks = run(model, IDS)
    q4_1 = [n for n in model.graph if n.op_type == "MatMulQ4_1"]
    down = Q4_1Weights.unpack(*(v.const_value.numpy() for v in q4_1[1].inputs[1:3]))
    assert pack_q4_1_records(model) == 3
    assert all(n.attributes["layout"].as_string() == RECORDS for n in q4_1)
    records, channels = (v.const_value.numpy() for v in q4_1[1].inputs[1:3])
    assert records.shape == (-(-H // 16), F // 32, 320) and channels.shape == (H, 0)
    back = Q4_1Weights.unpack_records(records, channels)
    assert np.array_equal(back.q, down.q) and np.array_equal(back.d, down.d) and np.array_equal(back.m, down.m)
    assert not [name for name in model.graph.initializers if name.endswith((".qs", ".dm"))]
    np.testing.assert_array_equal(run(model, IDS), blocks)
    assert pack_q4_1_records(model) == 0


def test_int4_lm_head_on_request():
    model, w = tiny_graph()
    assert quantize_int4(model, group_size=32, int4_lm_head=True) == 3
    up, down, head = (rtn.quantize_groupwise(w[name], 4, 32).dequantize() for name in ("up", "down", "embed"))
    assert_computes(model, forward(w, up, down, head))


@pytest.mark.parametrize("kernel", ["MatMulNBits", "MatMulQ4_1"])
@pytest.mark.parametrize("tied", [True, False])
def test_int4_rescored_lm_head_recomputes_its_top_k_from_the_8_bit_table(tied, kernel):
    """--lm-head int4-rescored: the int4 head's logits everywhere but its top k, those recomputed from the head's
    8-bit blocks (a tied head: the embedding Gather's own table). A MatMulQ4_1 head (int4-q4_1) is rescored at
    every row count; behind a 4-bit MatMulNBits head, steps of more than RESCORED_HEAD_MAX_ROWS rows take the
    int8 head instead (an If)."""
    from kiln.optimize.quantize_embedding import quantize_embedding
    from kiln.optimize.rescore_lm_head import head_rows, rescore_lm_head
    from kiln.quant_scheme import RESCORED_HEAD_MAX_ROWS

    top_k = 8
    model, w = tiny_graph()
    weight = w["embed"]
    if not tied:  # the head reads its own [H, V] initializer
        weight = (w["embed"] + 0.3 * np.random.default_rng(1).standard_normal(w["embed"].shape)).astype(np.float32)
        head = next(n for n in model.graph if n.name == "lm_head")
        head.replace_input_with(1, initializer(model, "head_t", np.ascontiguousarray(weight.T)))
    rows = head_rows(model)
    assert rows.source == ("embed" if tied else "head_t") and np.array_equal(rows.weight, weight)
    matrices = {"up": w["up"], "down": w["down"], "head": weight}
    if kernel == "MatMulQ4_1":
        assert quantize_q4_1_pass(model, int4_lm_head=True) == 3
        few_rows = None
        linear = lambda x, name: q4_1_linear(x, matrices[name])  # noqa: E731
    else:
        assert quantize_int4(model, group_size=32, int4_lm_head=True) == 3
        few_rows = RESCORED_HEAD_MAX_ROWS
        int4 = {name: rtn.quantize_groupwise(m, 4, 32).dequantize() for name, m in matrices.items()}
        linear = lambda x, name: x @ int4[name].T  # noqa: E731
    assert quantize_embedding(model) == 1
    assert rescore_lm_head(model, rows, top_k) == few_rows
    embedding = next(n for n in model.graph if n.op_type == "GatherBlockQuantized")
    switches = [n for n in model.graph if n.op_type == "If"]
    assert len(switches) == (few_rows is not None)
    graph = switches[0].attributes["else_branch"].as_graph() if switches else model.graph
    rescore = next(n for n in graph if n.op_type == "RescoreLogits")
    assert rescore.attributes["k"].as_int() == top_k
    assert (rescore.inputs[2] is embedding.inputs[0]) == tied  # a tied head's table is the embedding's
    assert [v.name for v in model.graph.outputs] == ["logits"]
    embed = rtn.quantize_groupwise(w["embed"], 8, 32).dequantize().astype(np.float64)
    table = rtn.quantize_groupwise(weight, 8, 32).dequantize().astype(np.float64)
    for ids in (IDS[:RESCORED_HEAD_MAX_ROWS], IDS[:1], IDS):
        h = embed[ids]
        r = linear(np.maximum(linear(h, "up") + w["up_bias"], 0), "down") + h
        if few_rows is not None and len(ids) > few_rows:
            reference = r @ rtn.per_channel_as_groups(weight, 128).dequantize().T  # --lm-head int8's head
        else:
            reference = linear(r, "head")
            top = np.argsort(-reference, axis=-1)[:, :top_k]
            np.put_along_axis(reference, top, np.einsum("td,tkd->tk", r, table[top]), axis=-1)
        np.testing.assert_allclose(run(model, ids, fp32_kernels=True), reference, rtol=0,
                                   atol=1e-5 * np.abs(reference).max())


def test_int4_rescored_lm_head_needs_a_float_head_and_an_int4_scheme():
    from kiln.optimize.quantize import QuantizationError, quantize_model
    from kiln.optimize.rescore_lm_head import head_rows, rescore_lm_head
    from kiln.quant_scheme import LmHead, QuantScheme

    with pytest.raises(QuantizationError, match="int4-rescored LM head goes with the int4 schemes"):
        quantize_model(tiny_graph()[0], QuantScheme.parse("int8-weight-only"), LmHead.INT4_RESCORED)
    model, _ = tiny_graph()
    rows = head_rows(model)
    assert quantize_int8_weight_only(model) == 3  # an int8 head: nothing to rescore behind
    with pytest.raises(ValueError, match="not from an int4 LM head"):
        rescore_lm_head(model, rows)
    with pytest.raises(ValueError, match="exactly one float LM head"):
        head_rows(model)


@pytest.mark.parametrize("scheme", ["int4-q4_1", "int4-rtn-g32"])
def test_w8a8_lm_head_on_request(scheme):
    """--lm-head w8a8: the head alone becomes per-token int8 x per-channel int8 (MatMulIntegerToFloat), the
    other linears take the scheme; the logits are the scheme's hidden state through the numpy w8a8 head."""
    from kiln.optimize.quantize import QuantizationError, quantize_model
    from kiln.quant_scheme import LmHead, QuantScheme

    model, w = tiny_graph()
    quantize_model(model, QuantScheme.parse(scheme), LmHead.W8A8)
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulIntegerToFloat") == 1 and ops.count("QuantizeLinear") == 1
    assert ops.count("MatMulQ4_1" if scheme == "int4-q4_1" else "MatMulNBits") == 2  # up and down only
    r = next(n for n in model.graph if n.op_type == "Add" and n.outputs[0].name == "r").outputs[0]
    r.type, r.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["T", H])
    model.graph.outputs.append(r)  # the head's input, as the scheme's linears computed it
    logits, hidden = run_all(model, IDS)
    scale = np.maximum(np.abs(hidden).max(-1, keepdims=True), 1e-8) / 127
    q, s = rtn.quantize_per_channel_int8(w["embed"])
    reference = (np.clip(np.round(hidden / scale), -127, 127) @ q.T.astype(np.float32)) * s * scale
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
    with pytest.raises(QuantizationError, match="w8a8 LM head goes with the int4 schemes"):
        quantize_model(tiny_graph()[0], QuantScheme.parse("int8-weight-only"), LmHead.W8A8)


def test_int8_weight_only_is_per_channel_and_close():
    model, w = tiny_graph()
    fp32 = run(model, IDS)
    assert quantize_int8_weight_only(model) == 3
    assert_computes(model, forward(w, *per_channel(w, "up", "down", "embed")))
    assert rel_err(run(model, IDS), fp32) < 0.02


@pytest.mark.parametrize("opset", [17, 18])
def test_w8a8_per_token_matches_numpy_reference(opset):
    model, w = tiny_graph(opset)
    fp32 = run(model, IDS)
    assert quantize_w8a8(model) == 3
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulIntegerToFloat") == 3
    assert ops.count("QuantizeLinear") == 3  # one per distinct activation
    out = run(model, IDS)
    assert rel_err(out, fp32) < 0.03

    # numpy reference of the same arithmetic: per-token symmetric int8 x per-channel int8
    def lin(x, wt, bias=None):
        r = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-8) / 127
        xq = np.clip(np.round(x / r), -127, 127)
        q, s = rtn.quantize_per_channel_int8(wt)
        y = (xq @ q.T.astype(np.float32)) * s * r
        return y if bias is None else y + bias

    h = w["embed"][IDS]
    a = np.maximum(lin(h, w["up"], w["up_bias"]), 0)
    r = lin(a, w["down"]) + h
    np.testing.assert_allclose(out, lin(r, w["embed"]), rtol=1e-4, atol=1e-3)


def test_passes_skip_graphs_without_linears():
    # a graph whose only weight is tiny is left alone
    small = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "s",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")],
    )
    m = ir.from_proto(helper.make_model(small))
    assert quantize_int4(m) == 0 and quantize_int8_weight_only(m) == 0 and quantize_w8a8(m) == 0
    assert [n.op_type for n in m.graph] == ["MatMul"]


@pytest.mark.parametrize("bits", [8, 4])
def test_embedding_table_becomes_gather_block_quantized(bits):
    from kiln.optimize.quantize_embedding import quantize_embedding

    model, w = tiny_graph()
    fp32 = run(model, IDS)
    assert quantize_int8_weight_only(model) == 3
    assert quantize_embedding(model, bits=bits) == 1
    ops = [n.op_type for n in model.graph]
    assert "Gather" not in ops and "GatherBlockQuantized" in ops
    assert "embed" not in model.graph.initializers  # the fp32 table is gone
    out = run(model, IDS)
    assert rel_err(out, fp32) < (0.03 if bits == 8 else 0.15)
    # the Gather reads exactly the reference quantizer's dequantized rows
    table = rtn.quantize_groupwise(w["embed"], bits, 32).dequantize()
    assert_computes(model, forward(w, *per_channel(w, "up", "down", "embed"), table=table))


# --- the fused projections (optimize/fuse_projections.py) through every scheme --------------------------

KV = H // 2  # k and v widths (grouped-query attention)


def qkv_graph(seed: int = 3, q4_1: bool = False, opset: int = 18) -> tuple[ir.Model, dict[str, np.ndarray]]:
    """A layer shaped like the engine's: q (with a bias) / k / v read the embedding h, gate / up read
    m = h + q + [k, v], then down, the residual and a tied LM head. q4_1: Q4_1-grid weights."""
    rng = np.random.default_rng(seed)
    shapes = {"q": (H, H), "k": (KV, H), "v": (KV, H), "gate": (F, H), "up": (F, H), "down": (H, F)}
    w = {name: (q4_1_weights(rng, *shape) if q4_1 else rng.standard_normal(shape) / np.sqrt(shape[1])).astype(
        np.float32) for name, shape in shapes.items()}
    w["embed"] = rng.standard_normal((V, H)).astype(np.float32)
    w["q_bias"] = (0.1 * rng.standard_normal(H)).astype(np.float32)
    inits = [numpy_helper.from_array(w["embed"], "embed"), numpy_helper.from_array(w["q_bias"], "q_bias")]
    inits += [numpy_helper.from_array(np.ascontiguousarray(w[name].T), f"{name}_t") for name in shapes]
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["h"])]
    nodes += [helper.make_node("MatMul", ["h", f"{name}_t"], [f"{name}_out"], name=name) for name in ("q", "k", "v")]
    nodes += [
        helper.make_node("Add", ["q_out", "q_bias"], ["qb"]),
        helper.make_node("Concat", ["k_out", "v_out"], ["kv"], axis=-1),
        helper.make_node("Sum", ["h", "qb", "kv"], ["m"]),
        helper.make_node("MatMul", ["m", "gate_t"], ["gate_out"], name="gate"),
        helper.make_node("MatMul", ["m", "up_t"], ["up_out"], name="up"),
        helper.make_node("Relu", ["gate_out"], ["g"]),
        helper.make_node("Mul", ["g", "up_out"], ["a"]),
        helper.make_node("MatMul", ["a", "down_t"], ["down_out"], name="down"),
        helper.make_node("Add", ["down_out", "m"], ["r"]),
        helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["r", "embed_t"], ["logits"], name="lm_head"),
    ]
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["T"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", V])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return ir.from_proto(model), w


def qkv_forward(w: dict[str, np.ndarray], linear) -> np.ndarray:
    """qkv_graph's network in numpy; linear(x, name) is the quantized x @ W_name.T (name "embed": the head)."""
    h = w["embed"][IDS].astype(np.float64)
    m = h + linear(h, "q") + w["q_bias"] + np.concatenate([linear(h, "k"), linear(h, "v")], -1)
    a = np.maximum(linear(m, "gate"), 0) * linear(m, "up")
    return linear(linear(a, "down") + m, "embed")


def fused_qkv_graph(q4_1: bool = False, opset: int = 18) -> tuple[ir.Model, dict[str, np.ndarray], np.ndarray]:
    """qkv_graph with q/k/v and gate/up fused, its weights and its fp32 logits."""
    from kiln.optimize.fuse_projections import fuse_projections

    model, w = qkv_graph(q4_1=q4_1, opset=opset)
    fp32 = run(model, IDS)
    assert fuse_projections(model) == 2
    assert len(find_linears(model)) == 4  # qkv, gate/up, down, head
    np.testing.assert_allclose(run(model, IDS), fp32, rtol=0, atol=1e-5 * np.abs(fp32).max())
    return model, w, fp32


def per_part(w: dict[str, np.ndarray], quantize, head=None):
    """linear(x, name) of qkv_forward with each part's weight quantized on its own (the head by head if given)."""
    def linear(x: np.ndarray, name: str) -> np.ndarray:
        return x @ (head if name == "embed" and head is not None else quantize)(w[name]).T
    return linear


def test_fused_projections_split_before_opset_13():
    """Split takes its sizes as an attribute before opset 13 (an input after)."""
    model, _, _ = fused_qkv_graph(opset=11)
    splits = [n for n in model.graph if n.op_type == "Split"]
    assert [list(n.attributes["split"].as_ints()) for n in splits] == [[H, KV, KV], [F, F]]


@pytest.mark.parametrize("group, int4_head", [(32, False), (128, False), (32, True)])
def test_fused_projections_int4_quantize_as_their_parts(group, int4_head):
    """Quantization is per output row: the fused matrix quantizes to exactly its parts' quantizations."""
    model, w, fp32 = fused_qkv_graph()
    assert quantize_int4(model, group_size=group, int4_lm_head=int4_head) == 4
    assert [n.op_type for n in model.graph].count("MatMulNBits") == 4
    int4 = lambda m: rtn.quantize_groupwise(m, 4, group).dequantize()  # noqa: E731
    int8 = lambda m: rtn.per_channel_as_groups(m, group).dequantize()  # noqa: E731
    reference = qkv_forward(w, per_part(w, int4, head=int4 if int4_head else int8))
    assert rel_err(reference, fp32) > 1e-3  # int4 moved the logits well past the tolerance below
    assert_computes(model, reference)


def test_fused_projections_int8_quantize_as_their_parts():
    model, w, fp32 = fused_qkv_graph()
    assert quantize_int8_weight_only(model) == 4
    assert_computes(model, qkv_forward(w, per_part(w, lambda m: rtn.per_channel_as_groups(m, 128).dequantize())))


@pytest.mark.parametrize("int4_head", [False, True])
def test_fused_projections_keep_q4_1_weights_exact(int4_head):
    model, w, fp32 = fused_qkv_graph(q4_1=True)
    assert quantize_q4_1_pass(model, int4_lm_head=int4_head) == 4
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulQ4_1") == 3 + int4_head and ops.count("MatMulNBits") == 1 - int4_head
    assert "ReduceSum" not in ops
    head = rtn.per_channel_as_groups(w["embed"], 128).dequantize()

    def linear(x, name):  # quantized row by row: the fused matrix is its parts' Q4_1, side by side
        return x @ head.T if name == "embed" and not int4_head else q4_1_linear(x, w[name])

    assert_computes(model, qkv_forward(w, linear))


def test_fused_projections_w8a8_matches_numpy_reference():
    model, w, fp32 = fused_qkv_graph()
    assert quantize_w8a8(model) == 4
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulIntegerToFloat") == 4 and ops.count("QuantizeLinear") == 4  # h, m, a, r

    def linear(x, name):
        r = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-8) / 127
        q, s = rtn.quantize_per_channel_int8(w[name])
        return (np.clip(np.round(x / r), -127, 127) @ q.T.astype(np.float32)) * s * r

    out = run(model, IDS)
    np.testing.assert_allclose(out, qkv_forward(w, linear), rtol=1e-4, atol=1e-3)
    assert rel_err(out, fp32) < 0.03
