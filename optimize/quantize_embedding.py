"""Pass: the token-embedding table -> com.microsoft::GatherBlockQuantized (8-bit blocks of 32).

Run after a linear pass: a tied LM head then already has its own quantized copy, so the fp32
table (the largest tensor of a small model: 113 MB for SmolLM2) is no longer needed at all.
A Gather reads one row per token, so this saves engine size and memory, not decode time.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .quant.graph import ensure_opset, initializer, prune
from .quant.nbits import MS_DOMAIN, _pack_nibbles
from .quant.rtn import quantize_groupwise

BLOCK_SIZE = 32
TABLE_KEY = "kiln.table"  # metadata of a GatherBlockQuantized: the float initializer its table was made from


def quantize_embedding(model: ir.Model, bits: int = 8, block_size: int = BLOCK_SIZE) -> int:
    """Rewrite every Gather(axis 0) of a constant 2-D float table in place; return how many."""
    count = 0
    for node in list(model.graph):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        table = node.inputs[0]
        axis = node.attributes.get("axis")
        if table is None or table.const_value is None or (axis is not None and axis.as_int() != 0):
            continue
        array = table.const_value.numpy()
        if array.ndim != 2 or array.dtype != np.float32 or array.shape[1] % block_size:
            continue
        qw = quantize_groupwise(array, bits, block_size)
        data, zp = (qw.q, qw.zero_points) if bits == 8 else (_pack_nibbles(qw.q), _pack_nibbles(qw.zero_points))
        name = table.name
        gather = ir.node(
            "GatherBlockQuantized",
            [initializer(model, f"{name}.q{bits}", np.ascontiguousarray(data)), node.inputs[1],
             initializer(model, f"{name}.scales", qw.scales), initializer(model, f"{name}.zero_points", zp)],
            attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": block_size, "bits": bits},
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
