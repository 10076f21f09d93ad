"""kiln.MatMulGGUF (domain "kiln", version 1): x @ W^T with W in a GGUF file's own blocks; contract and spec.

The ONNX Runtime CPU kernel (runtime/ops/matmul_gguf.cc) is tested against `matmul_gguf_ref`.

Attributes
  ggml_type         int: the blocks' GGUF type id, one of kiln/gguf_blocks.py's GgmlType (Q4_0, Q5_0, Q5_1, Q8_0,
                    Q4_K, Q5_K, Q6_K)
  int8_activations  int, optional (absent: 0): 1 quantizes x per row to int8 blocks and multiplies integers
                    (kiln/gguf_int8.py, the spec of that path: llama.cpp's arithmetic, what `--quantization gguf`
                    builds; Q4_0, Q8_0, Q4_K, Q5_K, Q6_K); 0 keeps x float32 (this module's spec: every type,
                    `--quantization gguf-exact`)
  layout            string, optional (absent: "blocks"): "records" holds Q4_K, Q5_K, Q6_K or Q8_0 weights
                    (int8_activations = 1, N a multiple of 16, K of 256) in the kernel's own layout, kiln.MatMulQ4_1's
                    records (kiln/gguf_records.py: the layouts and their spec; op-library ABI 12, 14 for Q5_K,
                    Q8_0); what a `gguf` engine stores for them
Inputs
  x          float32 [..., K]
  w          uint8   [N, K / QK * block bytes]   row n: output channel n's blocks, the bytes as the file holds them
                     (layout "records": [N / 16, K / 256, 2368 (Q4_K), 2880 (Q5_K), 3392 (Q6_K) or 4352 (Q8_0)])
  bias       float32 [N]                         optional
Output
  y          float32 [..., N]

Semantics with int8_activations = 0: ``y = x @ dequantize(w)^T (+ bias)``, dequantize being llama.cpp's
(kiln/gguf_blocks.py, equal to gguf-py's bit for bit). The activations stay float32: the kernel decodes each block
to float32 in registers and multiplies it into float32 accumulators, so the only difference from the spec (float64
sums here) is float32 rounding: a sub-block's products are summed in a different order, and its scale is applied
once per sub-block (``d * sc * (q . x) - dmin * m * sum(x)``) rather than per weight. Bound used by the tests: 1e-5
* (|x| @ |W|^T).

One op with the type as an attribute, not one op per type: the contract (shapes, checks, threading, the build
pass) is the same for every type, and the type is a constant of the node, so the kernel picks its block decoder
once, when the session creates it. A type is a decoder, not a new op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kiln.contract import OP_DOMAIN
from kiln.gguf_blocks import dequantize, ggml_type, row_weights
from kiln.gguf_records import BLOCKS, LAYOUT, RECORDS, pack_records
from kiln.op_models import single_node_model

if TYPE_CHECKING:
    from onnx import ModelProto

OP_TYPE = "MatMulGGUF"
TYPE_ATTRIBUTE = "ggml_type"
INT8_ATTRIBUTE = "int8_activations"


def matmul_gguf_ref(x: np.ndarray, w: np.ndarray, kind: int, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ dequantize(w)^T (+ bias), float64 sums; float32 [..., N]."""
    kind = ggml_type(kind)
    if w.ndim != 2 or w.dtype != np.uint8:
        raise ValueError(f"w must be uint8 [N, row bytes], got {w.dtype} {list(w.shape)}")
    k = row_weights(kind, w.shape[1])
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension {x.shape[-1]} is not the weight's K = {k}")
    y = x.reshape(-1, k).astype(np.float64) @ dequantize(w, kind).astype(np.float64).T
    if bias is not None:
        y = y + bias.astype(np.float64)
    return y.astype(np.float32).reshape(*x.shape[:-1], w.shape[0])


def make_single_op_model(w: np.ndarray, kind: int, bias: np.ndarray | None = None, rank: int = 2,
                         int8_activations: bool = False, layout: str = BLOCKS) -> ModelProto:
    """A one-node ONNX model y = kiln.MatMulGGUF(x, w[, bias]) with constant weights (the file's blocks, stored in
    `layout`), for tests and benchmarks. x is [T, K] (rank 2) or [B, T, K] (rank 3), the leading dims symbolic."""
    from onnx import TensorProto, helper, numpy_helper  # compile-time dependency only

    kind = ggml_type(kind)
    n, k = w.shape[0], row_weights(kind, w.shape[1])
    lead = ["B", "T"][3 - rank:]
    stored = pack_records(w, kind) if layout == RECORDS else w
    inits = [numpy_helper.from_array(np.ascontiguousarray(stored, dtype=np.uint8), "w")]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.astype(np.float32), "bias"))
    names = ["x", "w"] + (["bias"] if bias is not None else [])
    node = helper.make_node(OP_TYPE, names, ["y"], domain=OP_DOMAIN)
    node.attribute.append(helper.make_attribute(TYPE_ATTRIBUTE, int(kind)))
    if int8_activations:
        node.attribute.append(helper.make_attribute(INT8_ATTRIBUTE, 1))
    if layout != BLOCKS:
        node.attribute.append(helper.make_attribute(LAYOUT, layout))
    return single_node_model(node, "matmul_gguf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, k])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, n])], initializers=inits)
