"""kiln.SwiGLU (domain "kiln", version 1): the contract and its executable spec.

The ONNX Runtime CPU kernel (runtime/ops/swiglu.cc) is tested against `swiglu_ref`.

Input
  x   float32 [..., 2F]   any rank >= 1; the gate half first, then the up half (the fused gate/up
                          projection's output order, optimize/fuse_projections.py)
Output
  y   float32 [..., F]    y = silu(x[..., :F]) * x[..., F:],  silu(a) = a * sigmoid(a)

It replaces a LLaMA-family MLP's Split -> Sigmoid -> Mul -> Mul (optimize/fuse_swiglu.py): one pass over
[..., 2F] instead of three, and no copy into two halves. For finite input the output is finite: sigmoid is
computed from exp(-|a|), which never overflows (silu(-100) is -0.0 up to a denormal-sized value,
silu(100) = 100).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kiln.contract import OP_DOMAIN
from kiln.op_models import single_node_model

if TYPE_CHECKING:
    from onnx import ModelProto

OP_TYPE = "SwiGLU"
OP_VERSION = 1


def swiglu_ref(x: np.ndarray) -> np.ndarray:
    """silu(gate) * up over the last axis of x [..., 2F], in float64; float32 [..., F]."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2F] with an even last dimension, got {list(x.shape)}")
    f = x.shape[-1] // 2
    gate, up = x[..., :f].astype(np.float64), x[..., f:].astype(np.float64)
    # sigmoid from exp(-|a|) <= 1: no overflow for any finite a
    e = np.exp(-np.abs(gate))
    sigmoid = np.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    y: np.ndarray = (gate * sigmoid * up).astype(np.float32)
    return y


def make_single_op_model(rank: int = 2, width: int | str = "W") -> ModelProto:
    """A one-node ONNX model y = kiln.SwiGLU(x), x float32 of the given rank, its dims symbolic unless `width`
    (the last, 2F) is an integer; for tests and benchmarks."""
    from onnx import TensorProto, helper  # compile-time dependency only

    lead = [f"d{i}" for i in range(rank - 1)]
    out_width = width // 2 if isinstance(width, int) else "F"
    node = helper.make_node(OP_TYPE, ["x"], ["y"], domain=OP_DOMAIN)
    return single_node_model(node, "swiglu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, width])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, out_width])], OP_VERSION)
