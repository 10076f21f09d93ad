"""kiln.RescoreLogits (domain "kiln", version 1): the contract and its executable spec.

The ONNX Runtime CPU kernel (runtime/ops/rescore_logits.cc) is tested against `rescore_logits_ref`.

Inputs
  approx       float32 [..., V]    logits of a coarse (int4) LM head
  hidden       float32 [..., D]    the head's input, the same leading dims; D a multiple of 32
  data         uint8   [V, D]      the head's rows at 8 bits, blocks of 32 along D
  scales       float32 [V, D / 32]
  zero_points  uint8   [V, D / 32]
Attribute
  k            int >= 1            how many logits of each row to recompute (all of them when k >= V)
Output
  logits       float32 [..., V]    approx, with the k largest entries of each row replaced by
                                   sum_i (data[t, i] - zero_points[t, i // 32]) * scales[t, i // 32] * hidden[i]

The table is com.microsoft::GatherBlockQuantized's (bits 8, quantize_axis 1), so a tied head shares the
embedding's (optimize/quantize_embedding.py). Which k: the k largest values of the row, ties broken towards the
lower token id; NaN is never among them. It replaces TopK -> GatherBlockQuantized -> MatMul -> ScatterElements
(optimize/rescore_lm_head.py), which cost ~6% of a single-stream decode step on SmolLM2 (docs/design.md, "The
LM head"): ORT's TopK and the gather dequantize and copy what the op reads in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kiln.contract import OP_DOMAIN
from kiln.op_models import single_node_model

if TYPE_CHECKING:
    from onnx import ModelProto

OP_TYPE = "RescoreLogits"
OP_VERSION = 1
BLOCK = 32


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest values of a 1-d row (ties towards the lower id; NaN never chosen)."""
    ids = np.flatnonzero(~np.isnan(row))
    order = np.lexsort((ids, -row[ids].astype(np.float64)))  # by value descending, then id ascending
    return ids[order[:k]]


def rescore_logits_ref(approx: np.ndarray, hidden: np.ndarray, data: np.ndarray, scales: np.ndarray,
                       zero_points: np.ndarray, k: int) -> np.ndarray:
    """The op's output, the rescored logits in float64 arithmetic, as float32 [..., V]."""
    approx, hidden = np.asarray(approx, dtype=np.float32), np.asarray(hidden, dtype=np.float32)
    vocab, width = data.shape
    if approx.shape[-1] != vocab or hidden.shape[-1] != width or approx.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"approx {list(approx.shape)} and hidden {list(hidden.shape)} do not match a table "
                         f"{list(data.shape)}")
    rows = (data.astype(np.float64).reshape(vocab, -1, BLOCK) - zero_points[..., None]) * scales[..., None]
    table = rows.reshape(vocab, width)
    out = approx.reshape(-1, vocab).copy()
    for r, h in enumerate(hidden.reshape(-1, width).astype(np.float64)):
        top = top_k_ids(out[r], k)
        out[r, top] = (table[top] @ h).astype(np.float32)
    return out.reshape(approx.shape)


def make_single_op_model(k: int, rank: int = 2) -> ModelProto:
    """A one-node ONNX model logits = kiln.RescoreLogits(approx, hidden, data, scales, zero_points), every input
    a graph input with symbolic dims (the kernel checks them); for tests and benchmarks."""
    from onnx import TensorProto, helper  # compile-time dependency only

    lead = [f"d{i}" for i in range(rank - 1)]
    node = helper.make_node(OP_TYPE, ["approx", "hidden", "data", "scales", "zero_points"], ["logits"],
                            domain=OP_DOMAIN, k=k)
    inputs = [helper.make_tensor_value_info("approx", TensorProto.FLOAT, [*lead, "V"]),
              helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [*lead, "D"]),
              helper.make_tensor_value_info("data", TensorProto.UINT8, ["Vt", "Dt"]),
              helper.make_tensor_value_info("scales", TensorProto.FLOAT, ["Vs", "B"]),
              helper.make_tensor_value_info("zero_points", TensorProto.UINT8, ["Vz", "Bz"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*lead, "V"])]
    return single_node_model(node, "rescore_logits", inputs, outputs, OP_VERSION)
