"""Pass: the token-embedding table -> com.microsoft::GatherBlockQuantized (8-bit blocks of 32).

Run after a linear pass: a tied LM head then already has its own quantized copy, so the fp32
table (the largest tensor of a small model: 113 MB for SmolLM2) is no longer needed at all.
A Gather reads one row per token, so this saves engine size and memory, not decode time.

With file_blocks (the gguf scheme), a table read from a GGUF as Q8_0 or Q6_K blocks is stored as its own numbers
instead: both are ``(q - zero point) * scale`` per block of 32 (Q8_0: d, q + 128 against 128) or 16 (Q6_K: d * sc in
float32, as llama.cpp multiplies it, q against 32), which GatherBlockQuantized computes exactly. Other types' tables
(Q4_K / Q5_K: a float minimum per sub-block, no integer zero point) take the 8-bit blocks of 32 as every scheme does.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.gguf_blocks import FORMATS, GgmlType, q6_k_integers

from .quant.graph import ensure_opset, initializer, prune
from .quant.nbits import MS_DOMAIN, _pack_nibbles
from .quant.rtn import quantize_groupwise

BLOCK_SIZE = 32
TABLE_KEY = "kiln.table"  # metadata of a GatherBlockQuantized: the float initializer its table was made from


def quantize_embedding(model: ir.Model, bits: int = 8, block_size: int = BLOCK_SIZE, file_blocks: bool = False) -> int:
    """Rewrite every Gather(axis 0) of a constant 2-D float table in place; return how many. file_blocks: keep a
    GGUF table's Q8_0 / Q6_K numbers exactly."""
    count = 0
    for node in list(model.graph):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        table = node.inputs[0]
        axis = node.attributes.get("axis")
        if table is None or table.const_value is None or (axis is not None and axis.as_int() != 0):
            continue
        exact = _exact_blocks(table.const_value) if file_blocks else None
        if exact is not None:
            data, scales, zp = exact
            block, table_bits = data.shape[1] // scales.shape[1], 8
        else:
            array = table.const_value.numpy()
            if array.ndim != 2 or array.dtype != np.float32 or array.shape[1] % block_size:
                continue
            qw = quantize_groupwise(array, bits, block_size)
            data, zp = (qw.q, qw.zero_points) if bits == 8 else (_pack_nibbles(qw.q), _pack_nibbles(qw.zero_points))
            scales, block, table_bits = qw.scales, block_size, bits
        name = table.name
        gather = ir.node(
            "GatherBlockQuantized",
            [initializer(model, f"{name}.q{table_bits}", np.ascontiguousarray(data)), node.inputs[1],
             initializer(model, f"{name}.scales", scales), initializer(model, f"{name}.zero_points", zp)],
            attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": block, "bits": table_bits},
            domain=MS_DOMAIN,
            name=f"{name}.GatherBlockQuantized",
            metadata_props={TABLE_KEY: name},
        )
        ir.convenience.replace_nodes_and_values(
            model.graph, node, [node], [gather], [node.outputs[0]], [gather.outputs[0]]
        )
        count += 1
    if count:
        ensure_opset(model, MS_DOMAIN)
        prune(model)
    return count


def _exact_blocks(tensor: ir.TensorProtocol | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(uint8 data [V, D], float32 scales [V, D / block], uint8 zero points) holding a Q8_0 or Q6_K table's own
    numbers, or None for other tables."""
    parts = tuple(getattr(tensor, "blocks", ()))
    if len(parts) != 1 or parts[0].ggml_type not in (GgmlType.Q8_0, GgmlType.Q6_K):
        return None
    kind = GgmlType(parts[0].ggml_type)
    raw = parts[0].read()
    rows = raw.shape[0]
    blocks = raw.reshape(-1, FORMATS[kind].nbytes)
    if kind == GgmlType.Q8_0:  # d, then 32 int8: q + 128 against 128
        data, zero_point = blocks[:, 2:] ^ np.uint8(0x80), 128
        scales = np.ascontiguousarray(blocks[:, :2]).view(np.float16).astype(np.float32)
    else:  # Q6_K: q in 0..63 against 32, one float32 d * sc per 16 weights
        data, zero_point = q6_k_integers(blocks), 32
        d = np.ascontiguousarray(blocks[:, 208:210]).view(np.float16).astype(np.float32)
        scales = d * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    data = np.ascontiguousarray(data.reshape(rows, -1))
    scales = np.ascontiguousarray(scales.reshape(rows, -1))
    return data, scales, np.full(scales.shape, zero_point, np.uint8)
