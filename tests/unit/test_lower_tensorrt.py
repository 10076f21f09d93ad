"""optimize/lower_tensorrt.py: the backend-neutral engine graph rewritten for TensorRT's ONNX parser (checked here
on the graph: ONNX checker, node counts, plugin attributes; ONNX Runtime's fusions refused by name, as they never
reach this lowering). TensorRT itself does not run here; docs/design.md says how the plan build is verified."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from kiln.optimize.lower_tensorrt import (
    ATTENTION_OP,
    KV_WRITE_OP,
    PLUGIN_DOMAIN,
    UNUSED_INPUT,
    TensorRTLoweringError,
    lower_for_tensorrt,
)
from kiln.paged_attention import PagedAttentionAttrs, make_single_op_model
from kiln.swiglu import make_single_op_model as make_swiglu_model


def lowered(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    model = ir.from_proto(proto)
    counts = lower_for_tensorrt(model)
    result = ir.to_proto(model)
    onnx.checker.check_model(result, full_check=True)
    return result, counts


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize(("kv_dtype", "rotary"), [(np.float16, True), (np.int8, False)])
def test_paged_attention_becomes_kv_write_then_attention(kv_dtype, rotary):
    attrs = PagedAttentionAttrs(num_heads=9, num_kv_heads=3, sliding_window=7, rotary_interleaved=int(rotary))
    model, counts = lowered(make_single_op_model(attrs, 64, 16, kv_dtype, rotary=rotary))
    assert counts == {"paged_attention": 1}
    write, attend = model.graph.node
    assert (write.op_type, attend.op_type) == (KV_WRITE_OP, ATTENTION_OP)
    assert write.domain == attend.domain == PLUGIN_DOMAIN
    assert {o.domain for o in model.opset_import} == {"", PLUGIN_DOMAIN}  # no kiln CPU op, no com.microsoft
    scale, rope = ("kv_scale", UNUSED_INPUT) if kv_dtype == np.int8 else (UNUSED_INPUT, "cos_cache")
    assert list(write.input) == ["key", "value", "kv_cache", "block_tables", "seq_lens", "query_start_loc", scale,
                                 rope, rope.replace("cos", "sin")]
    # the graph output kv_cache_out is the write's (aliased) output, and attention reads the written pool
    assert list(write.output) == ["kv_cache_out"] and list(attend.input)[:2] == ["query", "kv_cache_out"]
    assert list(attend.input)[2:] == list(write.input)[3:] and list(attend.output) == ["out"]
    common = {"plugin_namespace": b"kiln", "plugin_version": b"1", "aot": 1, "num_kv_heads": 3,
              "rotary_interleaved": int(rotary)}
    assert attributes(write) == common
    assert attributes(attend) == {**common, "num_heads": 9, "scale": 0.125, "sliding_window": 7}  # 1/sqrt(64)
    initializers = [i.name for i in model.graph.initializer]
    assert initializers == [UNUSED_INPUT]  # the CPU op's empty kv_scale.none is gone


def rmsnorm_model() -> onnx.ModelProto:
    """x, skip [2, 3, 8] -> SkipSimplifiedLayerNormalization (normed and residual sum) -> SimplifiedLayerNorm."""
    rng = np.random.default_rng(0)
    gamma = helper.make_tensor("gamma", TensorProto.FLOAT, [8], rng.standard_normal(8).astype(np.float32))
    weight = helper.make_tensor("weight", TensorProto.FLOAT, [8], rng.standard_normal(8).astype(np.float32))
    nodes = [
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["normed", "", "", "total"],
                         domain="com.microsoft", epsilon=1e-5),
        helper.make_node("SimplifiedLayerNormalization", ["normed", "weight"], ["out"], epsilon=1e-6, axis=-1),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, 8]) for n in ("x", "skip", "out", "total")]
    graph = helper.make_graph(nodes, "norms", io[:2], io[2:], [gamma, weight])
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets,
                             ir_version=10)


def test_onnxruntime_fusions_are_refused_by_name():
    """RMSNorm and SwiGLU reach TensorRT as the standard ops the export wrote (optimize/pipeline.py is
    backend-neutral); ONNX Runtime's fused forms of them are its lowering's and refused here."""
    with pytest.raises(TensorRTLoweringError, match="::SimplifiedLayerNormalization, com.microsoft::Skip"):
        lower_for_tensorrt(ir.from_proto(rmsnorm_model()))
    with pytest.raises(TensorRTLoweringError, match="kiln::SwiGLU, which the TensorRT backend cannot run"):
        lower_for_tensorrt(ir.from_proto(make_swiglu_model(2, width=10)))


def test_quantized_matmuls_are_refused_by_name():
    node = helper.make_node("MatMulNBits", ["x", "w"], ["y"], domain="com.microsoft", K=8, N=8, bits=4,
                            block_size=32)
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
                                            helper.make_tensor_value_info("w", TensorProto.UINT8, [8, 1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("com.microsoft", 1)]))
    with pytest.raises(TensorRTLoweringError, match="com.microsoft::MatMulNBits, which the TensorRT backend"):
        lower_for_tensorrt(model)


def test_soft_capped_attention_is_refused_by_name():
    """Gemma 2's attention logit soft-cap is not in the TensorRT plugin: the lowering says so instead of dropping it."""
    attrs = PagedAttentionAttrs(num_heads=4, num_kv_heads=2, softcap=50.0)
    with pytest.raises(TensorRTLoweringError, match="soft-cap .* not implemented by the TensorRT plugin"):
        lowered(make_single_op_model(attrs, 64, 16))
