"""kiln.PagedAttention reading the fused QKV projection in place (the ONNX Runtime backend).

    X [1, T, (H + 2 Hkv) D] -> Split -> Reshape [-1, w] (x3) -> PagedAttention(q, k, v, ...) -> Reshape [1, -1, H D]
 -> PagedAttention(X, "", "", ...) -> out [1, T, H D]

After fuse_projections a layer's attention input is one Split of the fused projection into q, k and v, each
flattened to [T, width] for the op, and the op's [T, H*D] output is reshaped back to the graph's batch of one:
five nodes and a copy of every row per layer that only move data. The op's packed layout (key and value the
empty PACKED_QKV; kiln/paged_attention.py) reads q, k and v straight from the projection's rows, and a rank-3
query gives a rank-3 output.

A family that RMS-normalises q and k before RoPE has those norms between the Split and the op, as
SimplifiedLayerNormalization over each head (Qwen3, Gemma 3: a Reshape to [..., heads, D] before the norm, weight
[D]) or over the whole projection (OLMoE: weight [width]). They become the op's q_norm / k_norm inputs and its
qk_norm_epsilon, so such a layer packs too: nine nodes fewer a layer for Qwen3 (an engine needing them records
QK_NORM_ABI). Part of the ONNX Runtime lowering (optimize/lower_onnxruntime.py) only: the Triton/TensorRT kernels
take separate q, k, v. Quantization, which runs later, only swaps the MatMul above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from kiln.contract import OP_DOMAIN, OP_TYPE
from kiln.optimize._common import const_ints, empty_initializer, is_last_axis, producer_op, static_dim
from kiln.optimize.quant.graph import prune
from kiln.paged_attention import NO_ATTEND_UNTIL, NO_KV_SCALE, NO_ROTARY, PACKED_QKV

_NORM_SLOT = 11  # q_norm, then k_norm: after kv_scale (7), cos/sin (8, 9) and attend_until (10)
_EPSILON_DEFAULT = 1e-5  # SimplifiedLayerNormalization's epsilon when the attribute is absent


@dataclass
class _Operand:
    """How one of the op's q, k, v inputs comes from a Split output (`part`): the nodes in between (consumer
    first, removed once the op reads the projection) and the RMSNorm among them, if any."""

    part: ir.Value
    nodes: list[ir.Node] = field(default_factory=list)
    norm: ir.Value | None = None  # the norm's weight: [D] per head, or the part's width
    epsilon: float = _EPSILON_DEFAULT


def pack_attention_inputs(model: ir.Model) -> int:
    """Feed every kiln.PagedAttention whose q, k, v are one Split of a projection the projection itself (its q/k
    norms as the op's inputs); returns how many."""
    packed = 0
    for node in list(model.graph):
        if node.domain == OP_DOMAIN and node.op_type == OP_TYPE and _pack(model, node):
            packed += 1
    prune(model)  # the Split sizes, the Reshape shapes
    return packed


def has_qk_norms(model: ir.Model) -> bool:
    """Whether any kiln.PagedAttention takes q_norm / k_norm (the engine then needs QK_NORM_ABI)."""
    return any(node.domain == OP_DOMAIN and node.op_type == OP_TYPE and len(node.inputs) > _NORM_SLOT
               for node in model.graph)


def _pack(model: ir.Model, node: ir.Node) -> bool:
    heads, kv_heads = node.attributes["num_heads"].as_int(), node.attributes["num_kv_heads"].as_int()
    operands = [_operand(v) for v in node.inputs[:3]]
    if any(o is None for o in operands) or len(node.inputs) > _NORM_SLOT:
        return False
    q, k, v = operands  # type: ignore[misc]
    parts = [q.part, k.part, v.part]
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
    if not _norms_fit(q, k, v, head_dim, widths):  # type: ignore[arg-type]
        return False
    unflatten = _unflatten(node.outputs[0], heads * head_dim) if rank == 3 else None
    if rank == 3 and unflatten is None:
        return False  # a rank-3 output would reach readers that expect [T, H*D]
    empty = empty_initializer(model, PACKED_QKV)
    node.replace_input_with(0, fused)
    node.replace_input_with(1, empty)
    node.replace_input_with(2, empty)
    if q.norm is not None and k.norm is not None:
        _add_norms(model, node, q.norm, k.norm, q.epsilon)
    if unflatten is not None:
        # the op's output takes the Reshape's type with its shape: a shape without a type is not serialized
        node.outputs[0].type, node.outputs[0].shape = unflatten.outputs[0].type, unflatten.outputs[0].shape
        ir.convenience.replace_all_uses_with(unflatten.outputs[0], node.outputs[0])
        if not unflatten.outputs[0].is_graph_output():  # else the (now no-op) Reshape stays as its producer
            model.graph.remove(unflatten, safe=True)
    for operand in operands:
        for between in operand.nodes:  # type: ignore[union-attr]
            model.graph.remove(between, safe=True)
    model.graph.remove(split, safe=True)
    return True


def _operand(value: ir.Value | None) -> _Operand | None:
    """value's way from a Split output: optionally a Reshape [-1, width], over optionally an RMSNorm
    (SimplifiedLayerNormalization on the last axis, constant weight) of the part or of its [..., heads, D] Reshape;
    each value in between read by the next node alone. None for anything else."""
    if value is None or len(value.uses()) != 1:
        return None
    operand = _Operand(value)
    flatten = producer_op(value, "Reshape")
    if flatten is not None:
        target = const_ints(flatten.inputs[1])
        source = flatten.inputs[0]
        if source is None or len(source.uses()) != 1 or target is None or len(target) != 2 or target[0] != -1:
            return None
        operand.nodes.append(flatten)
        operand.part = source
        norm = producer_op(source, "SimplifiedLayerNormalization")
        if norm is None:
            return operand if static_dim(source, -1) == target[1] else None
        return _through_norm(operand, norm, target[1])
    return operand


def _through_norm(operand: _Operand, norm: ir.Node, width: int) -> _Operand | None:
    """operand continued through an RMSNorm of `width` values a token, per head or per row."""
    x, weight = (norm.inputs[0], norm.inputs[1]) if len(norm.inputs) >= 2 else (None, None)
    w = None if weight is None else ir.convenience.get_const_tensor(weight)
    if x is None or w is None or len(w.shape) != 1 or len(x.uses()) != 1 or len(norm.inputs) > 2:
        return None
    if not is_last_axis(norm.attributes.get_int("axis", -1), x) or any(o.uses() for o in norm.outputs[1:]):
        return None
    group = int(w.shape[0])
    operand.nodes.append(norm)
    operand.norm, operand.epsilon = weight, norm.attributes.get_float("epsilon", _EPSILON_DEFAULT)
    to_heads = producer_op(x, "Reshape")
    if group == width and to_heads is None:  # over the whole projection
        operand.part = x
        return operand if static_dim(x, -1) == width else None
    target = const_ints(to_heads.inputs[1]) if to_heads is not None else None
    source = to_heads.inputs[0] if to_heads is not None else None
    if to_heads is None or target is None or source is None or len(source.uses()) != 1 or width % group:
        return None
    if target[-2:] != [width // group, group] or static_dim(source, -1) != width:
        return None  # per head: [..., heads, D] of the part's rows
    operand.nodes.append(to_heads)
    operand.part = source
    return operand


def _norms_fit(q: _Operand, k: _Operand, v: _Operand, head_dim: int, widths: list[int]) -> bool:
    """No norm, or q and k both normalised with one epsilon, each per head (D) or over its projection; v never."""
    if v.norm is not None or (q.norm is None) != (k.norm is None):
        return False
    if q.norm is None or k.norm is None:
        return True
    sizes = [ir.convenience.get_const_tensor(n).shape[0] for n in (q.norm, k.norm)]  # type: ignore[union-attr]
    return q.epsilon == k.epsilon and sizes[0] in (head_dim, widths[0]) and sizes[1] in (head_dim, widths[1])


def _add_norms(model: ir.Model, node: ir.Node, q_norm: ir.Value, k_norm: ir.Value, epsilon: float) -> None:
    """node's q_norm / k_norm inputs (empty tensors in the optional places before them) and qk_norm_epsilon."""
    fillers = {7: (NO_KV_SCALE, np.float32), 8: (NO_ROTARY, np.float32), 9: (NO_ROTARY, np.float32),
               10: (NO_ATTEND_UNTIL, np.int32)}
    inputs = list(node.inputs)
    while len(inputs) < _NORM_SLOT:
        inputs.append(empty_initializer(model, *fillers[len(inputs)]))
    node.resize_inputs(_NORM_SLOT + 2)
    for slot, value in enumerate([*inputs, q_norm, k_norm]):
        if node.inputs[slot] is not value:
            node.replace_input_with(slot, value)
    node.attributes["qk_norm_epsilon"] = ir.AttrFloat32("qk_norm_epsilon", float(epsilon))


def _unflatten(out: ir.Value, width: int) -> ir.Node | None:
    """The op output's only reader when it is Reshape(out, [1, -1, width]) (back to the batch of one)."""
    uses = list(out.uses())
    if len(uses) != 1 or uses[0].idx != 0:
        return None
    reshape = uses[0].node
    if reshape.op_type != "Reshape" or reshape.domain not in ("", "ai.onnx"):
        return None
    return reshape if const_ints(reshape.inputs[1]) == [1, -1, width] else None

