"""Pass: Q4_1 (llama.cpp's 4-bit format: groups of 32, step and minimum) -> MatMulNBits + offsets.

``y = MatMulNBits(x) + blocksum(x) @ offsets^T`` where blocksum sums x over each group of 32
input channels (shared by the linears reading the same x) and offsets [N, K/32] holds what the
integer zero point leaves of each block's minimum (quant.rtn.quantize_q4_1). On a GGUF whose
weights are Q4_1 (the default SmolLM2) this reproduces them exactly, where any other int4 grid
rounds them a second time. The LM head (unless int4_lm_head: Q4_1 then too), and any linear whose
K is not a multiple of 32, is int8 per channel as in the int4 schemes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .quant.graph import ensure_opset, find_linears, initializer, is_lm_head, onnx_opset, prune, replace_linear
from .quant.nbits import MS_DOMAIN, make_matmul_nbits
from .quant.rtn import per_channel_as_groups, quantize_q4_1

GROUP_SIZE = 32


def _block_sums(model: ir.Model, x: ir.Value, k: int) -> tuple[list[ir.Node], ir.Value]:
    """Nodes computing x summed over each group of GROUP_SIZE channels: [..., K] -> [rows, K / 32]."""
    shape = initializer(model, f"q4_1.blocks_of_{k}", np.array([-1, k // GROUP_SIZE, GROUP_SIZE], np.int64))
    grouped = ir.node("Reshape", [x, shape])
    if onnx_opset(model) >= 13:
        axes = initializer(model, "q4_1.last_axis", np.array([-1], np.int64))
        total = ir.node("ReduceSum", [grouped.outputs[0], axes], attributes={"keepdims": 0})
    else:
        total = ir.node("ReduceSum", [grouped.outputs[0]], attributes={"axes": [-1], "keepdims": 0})
    return [grouped, total], total.outputs[0]


def quantize_q4_1_pass(model: ir.Model, int4_lm_head: bool = False) -> int:
    """Rewrite every linear MatMul in place; return how many were converted."""
    linears = find_linears(model)
    sums: dict[int, ir.Value] = {}  # id(activation) -> its block sums
    for lin in linears:
        k = lin.weight.shape[1]
        if (is_lm_head(lin) and not int4_lm_head) or k % GROUP_SIZE:
            node = make_matmul_nbits(model, lin.activation, per_channel_as_groups(lin.weight, 128),
                                     f"{lin.weight_name}.int8", lin.bias)
            replace_linear(model, lin, [node], node.outputs[0])
            continue
        qw = quantize_q4_1(lin.weight, GROUP_SIZE)
        nodes = [make_matmul_nbits(model, lin.activation, qw.ints, f"{lin.weight_name}.q4_1", lin.bias)]
        if id(lin.activation) not in sums:
            sum_nodes, sums[id(lin.activation)] = _block_sums(model, lin.activation, k)
            nodes = sum_nodes + nodes
        offsets = initializer(model, f"{lin.weight_name}.q4_1.offsets", np.ascontiguousarray(qw.offsets.T))
        side = ir.node("MatMul", [sums[id(lin.activation)], offsets])
        out = ir.node("Add", [nodes[-1].outputs[0], side.outputs[0]])
        replace_linear(model, lin, nodes + [side, out], out.outputs[0])
    if linears:
        ensure_opset(model, MS_DOMAIN)
        prune(model)
    return len(linears)
