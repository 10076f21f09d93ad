"""Lower the backend-neutral engine graph (optimize/pipeline.py) to what TensorRT's ONNX parser builds:
`kiln build --backend tensorrt`.

The neutral graph is standard ONNX ops (RMSNorm and the MLP's silu as the export writes them: TensorRT fuses
pointwise and normalization ops itself) and one op TensorRT does not know:

- kiln.PagedAttention (the CPU custom op) becomes two plugin nodes, one kernel each (a TensorRT AOT plugin
  embeds one kernel): PagedKvWrite writes the new tokens' K/V through the pool and returns it as
  kv_cache_out (its output aliased to its pool input: TensorRT's in-place plugin I/O), and PagedAttention reads
  that written pool, so the data dependency orders the two. The parser maps a node it has no importer for onto
  the plugin registered under (op_type, "plugin_namespace" attribute); "aot" = 1 selects the plugin's
  ahead-of-time implementation (plugins_trt/trt_plugin.py), which bakes the attributes into the kernel.
  A plugin takes every input always: an absent or empty kv_scale, cos or sin becomes a one-element float32
  initializer the kernels never read (float pool, RoPE outside the op).
- Anything else outside the standard domain (an ONNX Runtime fusion, an int4/int8 quantized MatMul) is
  refused: those are ONNX Runtime kernels, and the lowering runs on the neutral graph, before any of them.

The nodes' domain is PLUGIN_DOMAIN (declared in the opset imports, so the ONNX checker accepts the graph);
the parser looks plugins up by op_type and namespace, not by domain.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.contract import OP_DOMAIN, OP_TYPE
from kiln.optimize._common import add_opset

PLUGIN_DOMAIN = "kiln.trt"
PLUGIN_NAMESPACE = "kiln"
KV_WRITE_OP = "PagedKvWrite"
ATTENTION_OP = "PagedAttention"
PLUGIN_VERSION = 1
UNUSED_INPUT = "trt.unused_input"  # float32 [1]: a plugin input the kernels do not read
STANDARD_DOMAINS = ("", "ai.onnx", PLUGIN_DOMAIN)
# ONNX Runtime contrib ops registered in the default domain (its RMSNorm fusion's op)
ONNXRUNTIME_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


class TensorRTLoweringError(ValueError):
    """The graph holds an op the TensorRT backend cannot run; the message names it."""


def lower_for_tensorrt(model: ir.Model) -> dict[str, int]:
    """Rewrite model in place for TensorRT; returns how often each lowering fired."""
    counts = {"paged_attention": 0}
    graph = model.graph
    for node in list(graph):
        if node.domain == OP_DOMAIN and node.op_type == OP_TYPE:
            _split_paged_attention(graph, node)
            counts["paged_attention"] += 1
    foreign = sorted({f"{n.domain}::{n.op_type}" for n in graph
                      if n.domain not in STANDARD_DOMAINS or n.op_type in ONNXRUNTIME_DEFAULT_DOMAIN_OPS})
    if foreign:
        raise TensorRTLoweringError(f"the graph holds {', '.join(foreign)}, which the TensorRT backend cannot run "
                                    "(ONNX Runtime ops: lower the backend-neutral graph, built without "
                                    "--quantization)")
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
    if len(node.inputs) > 10:
        raise TensorRTLoweringError(f"{node.name}: attend_until (Gemma 3's bidirectional image attention) is not "
                                    "implemented by the TensorRT plugin; build this model for the onnxruntime backend")
    num_heads, num_kv_heads = attrs.get_int("num_heads"), attrs.get_int("num_kv_heads")
    head_dim = _static_width(query) // num_heads if _static_width(query) else None
    if attrs.get_float("softcap", 0.0):
        raise TensorRTLoweringError(f"{node.name}: the attention logit soft-cap (Gemma 2) is not implemented by the "
                                    "TensorRT plugin; build this model for the onnxruntime backend")
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
