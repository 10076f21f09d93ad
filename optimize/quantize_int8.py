"""Pass: weight-only int8, symmetric per output channel -> com.microsoft::MatMulNBits (bits=8).

MatMulNBits has group-wise scales only; each row's single scale is repeated over its groups
(zero point 128), which is per-channel int8 in that layout. accuracy_level=4 lets the kernel
quantize activations to int8 on the fly, its fast path on CPU.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.export.progress import track

from .quant.graph import ensure_opset, find_linears, prune, replace_linear
from .quant.nbits import MS_DOMAIN, make_matmul_nbits
from .quant.rtn import per_channel_as_groups

BLOCK_SIZE = 128  # layout granularity only: all blocks of a row share one scale


def quantize_int8_weight_only(model: ir.Model, block_size: int = BLOCK_SIZE) -> int:
    """Rewrite every linear MatMul in place; return how many were converted."""
    linears = find_linears(model)
    for lin in track(linears, "quantize int8", "linear"):
        qw = per_channel_as_groups(lin.weight, block_size)
        node = make_matmul_nbits(model, lin.activation, qw, f"{lin.weight_name}.int8", lin.bias)
        replace_linear(model, lin, [node], node.outputs[0])
    if linears:
        ensure_opset(model, MS_DOMAIN)
        prune(model)
    return len(linears)
