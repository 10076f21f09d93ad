"""kiln.PagedAttention reading the fused QKV projection in place (the ONNX Runtime backend).

    X [1, T, (H + 2 Hkv) D] -> Split -> Reshape [-1, w] (x3) -> PagedAttention(q, k, v, ...) -> Reshape [1, -1, H D]
 -> PagedAttention(X, "", "", ...) -> out [1, T, H D]

After fuse_projections a layer's attention input is one Split of the fused projection into q, k and v, each
flattened to [T, width] for the op, and the op's [T, H*D] output is reshaped back to the graph's batch of one:
five nodes and a copy of every row per layer that only move data. The op's packed layout (key and value the
empty PACKED_QKV; kiln/paged_attention.py) reads q, k and v straight from the projection's rows, and a rank-3
query gives a rank-3 output. Part of the ONNX Runtime lowering (optimize/lower_onnxruntime.py) only: the
Triton/TensorRT kernels take separate q, k, v. Quantization, which runs later, only swaps the MatMul above.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.contract import OP_DOMAIN, OP_TYPE
from kiln.optimize._common import const_ints, float_initializer, is_last_axis, producer_op, static_dim
from kiln.optimize.quant.graph import prune
from kiln.paged_attention import PACKED_QKV


def pack_attention_inputs(model: ir.Model) -> int:
    """Feed every kiln.PagedAttention whose q, k, v are one Split of a projection the projection itself;
    returns how many."""
    packed = 0
    for node in list(model.graph):
        if node.domain == OP_DOMAIN and node.op_type == OP_TYPE and _pack(model, node):
            packed += 1
    prune(model)  # the Split sizes and Reshape shapes
    return packed


def _pack(model: ir.Model, node: ir.Node) -> bool:
    heads, kv_heads = node.attributes["num_heads"].as_int(), node.attributes["num_kv_heads"].as_int()
    flats = [_flattened(v) for v in node.inputs[:3]]
    if any(f is None for f in flats):
        return False
    parts = [part for part, _ in flats]  # type: ignore[misc]
    split = producer_op(parts[0], "Split")
    if split is None or list(split.outputs) != parts:
        return False
    if not is_last_axis(split.attributes.get_int("axis", 0), split.inputs[0]):
        return False
    fused = split.inputs[0]
    rank = None if fused is None or fused.shape is None else len(fused.shape)
    widths = [static_dim(part, -1) for part in parts]
    if fused is None or rank not in (2, 3) or (rank == 3 and static_dim(fused, 0) != 1) or None in widths:
        return False
    head_dim = widths[0] // heads  # type: ignore[operator]
    if widths != [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]:
        return False
    unflatten = _unflatten(node.outputs[0], heads * head_dim) if rank == 3 else None
    if rank == 3 and unflatten is None:
        return False  # a rank-3 output would reach readers that expect [T, H*D]
    empty = _packed_qkv(model)
    node.replace_input_with(0, fused)
    node.replace_input_with(1, empty)
    node.replace_input_with(2, empty)
    if unflatten is not None:
        # the op's output takes the Reshape's type with its shape: a shape without a type is not serialized
        node.outputs[0].type, node.outputs[0].shape = unflatten.outputs[0].type, unflatten.outputs[0].shape
        ir.convenience.replace_all_uses_with(unflatten.outputs[0], node.outputs[0])
        if not unflatten.outputs[0].is_graph_output():  # else the (now no-op) Reshape stays as its producer
            model.graph.remove(unflatten, safe=True)
    for reshape in {id(r): r for _, r in flats if r is not None}.values():
        model.graph.remove(reshape, safe=True)
    model.graph.remove(split, safe=True)
    return True


def _flattened(value: ir.Value | None) -> tuple[ir.Value, ir.Node | None] | None:
    """(the Split output behind value, the Reshape [-1, width] between them or None) when value is only the op's."""
    if value is None or len(value.uses()) != 1:
        return None
    reshape = producer_op(value, "Reshape")
    if reshape is None:
        return value, None
    source = reshape.inputs[0]
    target = const_ints(reshape.inputs[1])
    if source is None or len(source.uses()) != 1 or target is None or len(target) != 2 or target[0] != -1:
        return None
    return (source, reshape) if static_dim(source, -1) == target[1] else None


def _unflatten(out: ir.Value, width: int) -> ir.Node | None:
    """The op output's only reader when it is Reshape(out, [1, -1, width]) (back to the batch of one)."""
    uses = list(out.uses())
    if len(uses) != 1 or uses[0].idx != 0:
        return None
    reshape = uses[0].node
    if reshape.op_type != "Reshape" or reshape.domain not in ("", "ai.onnx"):
        return None
    return reshape if const_ints(reshape.inputs[1]) == [1, -1, width] else None


def _packed_qkv(model: ir.Model) -> ir.Value:
    """The shared empty float32 [0] that stands for the key and value of a packed op."""
    initializers = model.graph.initializers
    if PACKED_QKV not in initializers:
        model.graph.register_initializer(float_initializer(PACKED_QKV, np.zeros(0, np.float32)))
    return initializers[PACKED_QKV]
