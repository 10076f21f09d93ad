"""Recognise rotary embeddings (RoPE) as exporters write them, for kiln.PagedAttention to apply in the op.

Hugging Face's `x * cos + rotate_half(x) * sin` traces (kiln's export and transformers' dynamo
export alike) to

    Add(Mul(x, Unsqueeze(Cos(E))), Mul(Concat(Neg(Slice(x, D/2:)), Slice(x, :D/2)), Unsqueeze(Sin(E))))
    E = Concat(F, F, axis=-1),  F = Mul(Cast(position_ids ...), inv_freq)

with the operands of each Add/Mul in either order. `match_rotary` returns x and the constant
inv_freq [D/2] (rope scaling is already folded into it by the exporter), so the caches the op reads
come from the very frequencies the graph used: cos/sin(p * inv_freq) in float32, as the graph computes
them. Anything else (partial rotary dims, interleaved pairs, an attention_scaling factor on cos/sin)
does not match, and the fusion then leaves RoPE as graph ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln import contract
from kiln.optimize._common import const_ints, producer_op


@dataclass(frozen=True)
class RotaryMatch:
    source: ir.Value  # x before RoPE, [B, heads, T, D]
    inv_freq: np.ndarray  # float32 [D/2]


def rotary_tables(inv_freq: np.ndarray, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos_cache, sin_cache float32 [positions, D/2]: the graph's Cos/Sin of p * inv_freq, row p."""
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def match_rotary(value: ir.Value) -> RotaryMatch | None:
    """x and inv_freq if value is RoPE(x) in the rotate_half form above, else None."""
    add = producer_op(value, "Add")
    if add is None:
        return None
    for cos_term, sin_term in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        x, cos_freq = _split_product(cos_term, "Cos")
        rotated, sin_freq = _split_product(sin_term, "Sin")
        if x is None or rotated is None or cos_freq is None or sin_freq is None:
            continue
        if not np.array_equal(cos_freq, sin_freq) or not _is_rotate_half(rotated, x, 2 * len(cos_freq)):
            continue
        return RotaryMatch(x, cos_freq)
    return None


def _split_product(value: ir.Value, trig: str) -> tuple[ir.Value | None, np.ndarray | None]:
    """Mul(a, Unsqueeze(trig(E))) in either order -> (a, inv_freq of E)."""
    mul = producer_op(value, "Mul")
    if mul is None:
        return None, None
    for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        unsqueeze = producer_op(b, "Unsqueeze")  # [B, T, D] -> [B, 1, T, D]: one row for every head
        if unsqueeze is None or const_ints(unsqueeze.inputs[1]) != [1]:
            continue
        node = producer_op(unsqueeze.inputs[0], trig)
        inv_freq = _angle_frequencies(node.inputs[0]) if node else None
        if inv_freq is not None:
            return a, inv_freq
    return None, None


def _angle_frequencies(angles: ir.Value | None) -> np.ndarray | None:
    """inv_freq if angles == Concat(F, F, axis=-1) with F = Mul(Cast(position_ids ...), inv_freq)."""
    concat = producer_op(angles, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.inputs[0] is not concat.inputs[1]:
        return None
    mul = producer_op(concat.inputs[0], "Mul")
    if mul is None:
        return None
    for positions, freq in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        tensor = ir.convenience.get_const_tensor(freq) if freq is not None else None
        if tensor is None or not _from_position_ids(positions):
            continue
        inv_freq = np.asarray(tensor.numpy())
        if inv_freq.dtype == np.float32 and inv_freq.ndim == 1 and inv_freq.size:
            return inv_freq
    return None


def _from_position_ids(value: ir.Value | None) -> bool:
    """value is the graph input position_ids through shape-only ops and a Cast."""
    while value is not None and value.producer() is not None:
        node = value.producer()
        if node.op_type not in ("Cast", "Unsqueeze", "Reshape", "Expand") or node.domain not in ("", "ai.onnx"):
            return False
        value = node.inputs[0]
    return value is not None and value.name in (contract.POSITION_IDS, contract.POSITION_IDS + "_2d")


def _is_rotate_half(value: ir.Value, x: ir.Value, head_dim: int) -> bool:
    """value == Concat(Neg(Slice(x, D/2:D)), Slice(x, 0:D/2)) along the last axis."""
    concat = producer_op(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis") not in (-1, 3):
        return False
    neg = producer_op(concat.inputs[0], "Neg")
    return neg is not None and _is_half(neg.inputs[0], x, head_dim, 1) and _is_half(concat.inputs[1], x, head_dim, 0)


def _is_half(value: ir.Value | None, x: ir.Value, head_dim: int, which: int) -> bool:
    """value == Slice(x) over the last axis: the first (which 0) or second (1) half of head_dim."""
    node = producer_op(value, "Slice")
    if node is None or node.inputs[0] is not x or len(node.inputs) < 4:
        return False
    starts, ends, axes = (const_ints(v) for v in node.inputs[1:4])
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 else [1]
    half = head_dim // 2
    if axes not in ([-1], [3]) or steps != [1] or starts is None or ends is None:
        return False
    return (starts, min(ends[0], head_dim)) == ([half * which], half * (which + 1))
