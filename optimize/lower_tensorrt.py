"""Lower an engine graph (kiln/contract.py) to what TensorRT's ONNX parser builds: `kiln build --backend tensorrt`.

The ONNX Runtime graph has three kinds of nodes TensorRT does not know:

- kiln.PagedAttention (the CPU custom op) becomes two plugin nodes, one kernel each (a TensorRT AOT plugin
  embeds one kernel): PagedKvWrite writes the new tokens' K/V through the pool and returns it as
  kv_cache_out (its output aliased to its pool input: TensorRT's in-place plugin I/O), and PagedAttention reads
  that written pool, so the data dependency orders the two. The parser maps a node it has no importer for onto
  the plugin registered under (op_type, "plugin_namespace" attribute); "aot" = 1 selects the plugin's
  ahead-of-time implementation (plugins_trt/trt_plugin.py), which bakes the attributes into the kernel.
  A plugin takes every input always: an absent or empty kv_scale, cos or sin becomes a one-element float32
  initializer the kernels never read (float pool, RoPE outside the op).
- SimplifiedLayerNormalization and com.microsoft SkipSimplifiedLayerNormalization (ORT's RMSNorm fusions)
  become the standard ops they fused: x * 1/sqrt(mean(x^2) + eps) * weight, and the residual Add before it.
- kiln.SwiGLU (the CPU MLP activation) becomes the standard ops it fused: silu(gate) * up as two constant
  Slices of the last axis, Sigmoid and two Muls (TensorRT fuses the pointwise ops itself). Its input's last
  dim must be static (it is: the fused gate/up weight's width).
- Anything else outside the standard domain (an int4/int8 quantized MatMul) is refused: those are ORT CPU
  kernels, and this backend serves float weights.

The nodes' domain is PLUGIN_DOMAIN (declared in the opset imports, so the ONNX checker accepts the graph);
the parser looks plugins up by op_type and namespace, not by domain.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln import swiglu
from kiln.contract import OP_DOMAIN, OP_TYPE
from kiln.optimize._common import add_opset

PLUGIN_DOMAIN = "kiln.trt"
PLUGIN_NAMESPACE = "kiln"
KV_WRITE_OP = "PagedKvWrite"
ATTENTION_OP = "PagedAttention"
PLUGIN_VERSION = 1
UNUSED_INPUT = "trt.unused_input"  # float32 [1]: a plugin input the kernels do not read
STANDARD_DOMAINS = ("", "ai.onnx", PLUGIN_DOMAIN)


class TensorRTLoweringError(ValueError):
    """The graph holds an op the TensorRT backend cannot run; the message names it."""


def lower_for_tensorrt(model: ir.Model) -> dict[str, int]:
    """Rewrite model in place for TensorRT; returns how often each lowering fired."""
    counts = {"paged_attention": 0, "rmsnorm": 0, "skip_rmsnorm": 0, "swiglu": 0}
    graph = model.graph
    for node in list(graph):
        if node.domain == OP_DOMAIN and node.op_type == OP_TYPE:
            _split_paged_attention(graph, node)
            counts["paged_attention"] += 1
        elif node.domain == OP_DOMAIN and node.op_type == swiglu.OP_TYPE:
            _lower_swiglu(graph, node)
            counts["swiglu"] += 1
        elif node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx", "com.microsoft"):
            _lower_rmsnorm(graph, node)
            counts["rmsnorm"] += 1
        elif node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == "com.microsoft":
            _lower_skip_rmsnorm(graph, node)
            counts["skip_rmsnorm"] += 1
    foreign = sorted({f"{n.domain}::{n.op_type}" for n in graph if n.domain not in STANDARD_DOMAINS})
    if foreign:
        raise TensorRTLoweringError(f"the graph holds {', '.join(foreign)}, which the TensorRT backend cannot run "
                                    "(build it without --quantization for --backend tensorrt)")
    for name, value in list(graph.initializers.items()):  # e.g. the CPU op's empty kv_scale.none
        if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
            del graph.initializers[name]
    model.opset_imports.pop(OP_DOMAIN, None)
    model.opset_imports.pop("com.microsoft", None)
    add_opset(model, PLUGIN_DOMAIN, PLUGIN_VERSION)
    return counts


def _unused_input(graph: ir.Graph) -> ir.Value:
    if UNUSED_INPUT not in graph.initializers:
        value = ir.Value(name=UNUSED_INPUT, const_value=ir.tensor(np.zeros(1, np.float32), name=UNUSED_INPUT))
        graph.register_initializer(value)
    return graph.initializers[UNUSED_INPUT]


def _present(graph: ir.Graph, value: ir.Value | None) -> ir.Value:
    """value, or the unused input where it is absent or an empty tensor (the CPU op's kv_scale.none)."""
    empty = value is not None and value.shape is not None and value.shape.is_static() and 0 in value.shape.dims
    return _unused_input(graph) if value is None or empty else value


def _split_paged_attention(graph: ir.Graph, node: ir.Node) -> None:
    query, key, value, pool, tables, seq_lens, qsl, *optional = list(node.inputs) + [None] * (10 - len(node.inputs))
    kv_scale, cos, sin = (_present(graph, v) for v in optional[:3])
    attrs = node.attributes
    num_heads, num_kv_heads = attrs.get_int("num_heads"), attrs.get_int("num_kv_heads")
    head_dim = _static_width(query) // num_heads if _static_width(query) else None
    scale = attrs.get_float("scale", 0.0)
    if not scale:
        if head_dim is None:
            raise TensorRTLoweringError(f"{node.name}: scale 0 (1/sqrt(head_dim)) needs a query of static width")
        scale = 1.0 / float(np.sqrt(head_dim))
    common = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": str(PLUGIN_VERSION), "aot": 1,
              "num_kv_heads": num_kv_heads, "rotary_interleaved": attrs.get_int("rotary_interleaved", 0)}
    write = ir.node(KV_WRITE_OP, [key, value, pool, tables, seq_lens, qsl, kv_scale, cos, sin], common,
                    domain=PLUGIN_DOMAIN, name=f"{node.name}/kv_write")
    written = write.outputs[0]
    attend = ir.node(ATTENTION_OP, [query, written, tables, seq_lens, qsl, kv_scale, cos, sin],
                     {**common, "num_heads": num_heads, "scale": float(scale),
                      "sliding_window": attrs.get_int("sliding_window", 0)},
                     domain=PLUGIN_DOMAIN, name=f"{node.name}/attention")
    out, pool_out = node.outputs
    ir.convenience.replace_nodes_and_values(graph, node, [node], [write, attend], [out, pool_out],
                                            [attend.outputs[0], written])


def _static_width(value: ir.Value) -> int | None:
    dim = value.shape[-1] if value.shape is not None and len(value.shape) else None
    return dim if isinstance(dim, int) else None


def _rms(nodes: list[ir.Node], x: ir.Value, weight: ir.Value, epsilon: float, name: str) -> ir.Value:
    """x / sqrt(mean(x^2, last axis) + epsilon) * weight, as standard ops appended to nodes."""
    def add(op: str, *inputs: ir.Value, **attributes: int) -> ir.Value:
        new = ir.node(op, list(inputs), attributes or None, name=f"{name}/{op}_{len(nodes)}")
        nodes.append(new)
        return new.outputs[0]

    axes_const = ir.node("Constant", [], {"value": ir.tensor(np.array([-1], np.int64))}, name=f"{name}/axes")
    eps_const = ir.node("Constant", [], {"value": ir.tensor(np.array(epsilon, np.float32))}, name=f"{name}/epsilon")
    nodes += [axes_const, eps_const]
    mean = add("ReduceMean", add("Mul", x, x), axes_const.outputs[0], keepdims=1)
    inv = add("Reciprocal", add("Sqrt", add("Add", mean, eps_const.outputs[0])))
    return add("Mul", add("Mul", x, inv), weight)


def _check_rms_attrs(node: ir.Node) -> float:
    axis = node.attributes.get_int("axis", -1)
    if axis != -1 and (node.inputs[0] is None or node.inputs[0].shape is None or
                       axis != len(node.inputs[0].shape) - 1):
        raise TensorRTLoweringError(f"{node.name}: an RMSNorm over axis {axis}, not the last, is not lowered")
    return node.attributes.get_float("epsilon", 1e-5)


def _lower_rmsnorm(graph: ir.Graph, node: ir.Node) -> None:
    epsilon = _check_rms_attrs(node)
    x, weight = node.inputs[0], node.inputs[1]
    assert x is not None and weight is not None
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        raise TensorRTLoweringError(f"{node.name}: an RMSNorm whose inv_std_var output is read is not lowered")
    nodes: list[ir.Node] = []
    out = _rms(nodes, x, weight, epsilon, node.name or "rmsnorm")
    ir.convenience.replace_nodes_and_values(graph, node, [node], nodes, [node.outputs[0]], [out])


def _lower_skip_rmsnorm(graph: ir.Graph, node: ir.Node) -> None:
    """outputs (normed, mean, inv_std_var, input_skip_bias_sum): the first and last are lowered, and the two
    statistics must be unread (kiln's fusion never reads them)."""
    epsilon = _check_rms_attrs(node)
    x, skip, gamma, *rest = node.inputs
    assert x is not None and skip is not None and gamma is not None
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:3]):
        raise TensorRTLoweringError(f"{node.name}: a SkipSimplifiedLayerNormalization whose mean or inv_std_var "
                                    "output is read is not lowered")
    name = node.name or "skip_rmsnorm"
    total_node = ir.node("Add", [x, skip], name=f"{name}/residual")
    nodes = [total_node]
    total = total_node.outputs[0]
    if rest and rest[0] is not None:  # the optional bias
        bias_node = ir.node("Add", [total, rest[0]], name=f"{name}/bias")
        nodes.append(bias_node)
        total = bias_node.outputs[0]
    out = _rms(nodes, total, gamma, epsilon, name)
    old = [node.outputs[0]] + ([node.outputs[3]] if len(node.outputs) > 3 else [])
    ir.convenience.replace_nodes_and_values(graph, node, [node], nodes, old, [out, total][:len(old)])


def _lower_swiglu(graph: ir.Graph, node: ir.Node) -> None:
    """y = x[..., :F] * Sigmoid(x[..., :F]) * x[..., F:] with constant Slices (F from x's static width)."""
    x = node.inputs[0]
    assert x is not None
    width = _static_width(x)
    if width is None or width % 2:
        raise TensorRTLoweringError(f"{node.name}: a kiln.SwiGLU whose input width is not a static even number "
                                    f"({width}) is not lowered")
    half, name = width // 2, node.name or "swiglu"

    def const(suffix: str, value: int) -> ir.Node:
        return ir.node("Constant", [], {"value": ir.tensor(np.array([value], np.int64))}, name=f"{name}/{suffix}")

    zero, mid, end, axis = const("zero", 0), const("half", half), const("end", width), const("axis", -1)
    gate = ir.node("Slice", [x, zero.outputs[0], mid.outputs[0], axis.outputs[0]], name=f"{name}/gate")
    up = ir.node("Slice", [x, mid.outputs[0], end.outputs[0], axis.outputs[0]], name=f"{name}/up")
    sigmoid = ir.node("Sigmoid", [gate.outputs[0]], name=f"{name}/sigmoid")
    silu = ir.node("Mul", [gate.outputs[0], sigmoid.outputs[0]], name=f"{name}/silu")
    out = ir.node("Mul", [silu.outputs[0], up.outputs[0]], name=f"{name}/mul")
    ir.convenience.replace_nodes_and_values(graph, node, [node], [zero, mid, end, axis, gate, up, sigmoid, silu, out],
                                            [node.outputs[0]], [out.outputs[0]])
