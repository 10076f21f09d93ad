"""Pass: Q4_1 (llama.cpp's 4-bit format: blocks of 32, float16 step and minimum) -> kiln.MatMulQ4_1.

Each linear becomes one kiln.MatMulQ4_1 node (kiln/matmul_q4_1.py: Q4_1 weights times activations
quantized per block of 32 to int8, the minimum's term m * sum(x_block) exact). On a GGUF whose
weights are Q4_1 (the default SmolLM2) this reproduces them exactly, where any other int4 grid
rounds them a second time. The LM head (unless int4_lm_head: Q4_1 then too), and any linear whose
K is not a multiple of 32, is int8 per channel (MatMulNBits) as in the int4 schemes.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.contract import OP_DOMAIN
from kiln.export.progress import track
from kiln.matmul_q4_1 import BLOCK, OP_TYPE

from .quant.graph import ensure_opset, find_linears, initializer, is_lm_head, prune, replace_linear
from .quant.nbits import MS_DOMAIN, make_matmul_nbits
from .quant.rtn import per_channel_as_groups, quantize_q4_1


def quantize_q4_1_pass(model: ir.Model, int4_lm_head: bool = False) -> int:
    """Rewrite every linear MatMul in place; return how many were converted."""
    linears = find_linears(model)
    for lin in track(linears, "quantize q4_1", "linear"):
        weight = lin.weight  # read once: the build's initializers are lazy
        if (is_lm_head(lin) and not int4_lm_head) or lin.shape[1] % BLOCK:
            node = make_matmul_nbits(model, lin.activation, per_channel_as_groups(weight, 128),
                                     f"{lin.weight_name}.int8", lin.bias)
            ensure_opset(model, MS_DOMAIN)
        else:
            qs, dm = quantize_q4_1(weight).pack()
            inputs = [lin.activation, initializer(model, f"{lin.weight_name}.q4_1.qs", qs),
                      initializer(model, f"{lin.weight_name}.q4_1.dm", dm)]
            node = ir.node(OP_TYPE, inputs + ([lin.bias] if lin.bias is not None else []), domain=OP_DOMAIN,
                           name=f"{lin.weight_name}.MatMulQ4_1")
            ensure_opset(model, OP_DOMAIN)
        replace_linear(model, lin, [node], node.outputs[0])
    if linears:
        prune(model)
    return len(linears)
