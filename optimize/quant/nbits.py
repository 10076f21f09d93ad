"""Packing into ``com.microsoft::MatMulNBits`` (onnxruntime contrib op) and building its node.

Layout (ORT contrib-op spec, bits in {4, 8}):
  B            uint8 [N, n_blocks, block_size * bits / 8]; 4-bit: element 2j in the low nibble
  scales       float [N * n_blocks]
  zero_points  uint8 [N * ceil(n_blocks * bits / 8)]; 4-bit: block 2j in the low nibble
Y = A @ dequant(B)^T with dequant = (q - zero_point) * scale, A [..., K], Y [..., N].
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .graph import initializer
from .rtn import GroupQuantized

MS_DOMAIN = "com.microsoft"
ACCURACY_LEVEL_INT8 = 4  # activations quantized to int8 inside the kernel: the fast CPU path


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Pack uint8 values < 16 along the last axis, two per byte, first one in the low nibble."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def pack(qw: GroupQuantized) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, scales, zero_points) arrays in MatMulNBits layout."""
    n = qw.q.shape[0]
    n_blocks = qw.scales.shape[1]
    blocks = qw.q.reshape(n, n_blocks, qw.group_size)
    if qw.bits == 4:
        b = _pack_nibbles(blocks)
        zp = _pack_nibbles(qw.zero_points).reshape(-1)
    elif qw.bits == 8:
        b = blocks.copy()
        zp = qw.zero_points.reshape(-1).copy()
    else:
        raise ValueError(f"MatMulNBits packing supports 4 and 8 bits, not {qw.bits}")
    return b, qw.scales.reshape(-1).astype(np.float32), zp


def make_matmul_nbits(model: ir.Model, activation: ir.Value, qw: GroupQuantized, prefix: str,
                      bias: ir.Value | None = None) -> ir.Node:
    """A MatMulNBits node computing ``activation @ dequant(qw)^T (+ bias)``; initializers registered."""
    b, scales, zp = pack(qw)
    inputs = [
        activation,
        initializer(model, f"{prefix}.q{qw.bits}", b),
        initializer(model, f"{prefix}.scales", scales),
        initializer(model, f"{prefix}.zero_points", zp),
    ]
    if bias is not None:
        inputs += [None, bias]  # g_idx unused
    return ir.node(
        "MatMulNBits",
        inputs,
        attributes={"K": qw.k, "N": qw.q.shape[0], "bits": qw.bits, "block_size": qw.group_size,
                    "accuracy_level": ACCURACY_LEVEL_INT8},
        domain=MS_DOMAIN,
        name=f"{prefix}.MatMulNBits",
    )
