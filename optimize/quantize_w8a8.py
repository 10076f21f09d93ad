"""Pass: W8A8 — int8 per-channel weights, per-token dynamic int8 activations.

Meant for SmoothQuant: the smoothing scales are already folded into the weights (and the
preceding RMSNorm) by ``kiln.calibration.artifact.apply_artifact`` before export, so the
activations have no outlier channels left and plain per-token quantization is accurate.

Per activation tensor (shared by every linear that reads it, e.g. q/k/v):
    r  = max(ReduceMax(|x|, axis=-1), eps) / 127              per-token scale [..., 1]
    xq = QuantizeLinear(x / r, scale=1, zero_point=128)        uint8
Per linear:
    y  = MatMulIntegerToFloat(xq, Wq + 128 uint8 [K, N], 1, w_scale [N], 128, 128) * r  (+ bias)
The weights are stored offset to uint8 (zero point 128) so that ONNX Runtime takes its u8u8
kernel, which is exact on every x86 CPU: its u8s8 kernel on AVX2 without VNNI sums pairs of
u8*s8 products in int16 (vpmaddubsw) and saturates (up to 15% error per output measured on a
SmolLM2-sized linear), while u8u8 widens to int16 first; both cost the same there.
Measured on the 2-core CPU with SmolLM2 shapes: about as fast as MatMulNBits(bits=8) at one
token and 2-5x faster than it (and than fp32) at 64 tokens; per-tensor DynamicQuantizeMatMul
is no faster at one token and loses accuracy on tokens with small activations.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from kiln.export.progress import track

from .quant.graph import Linear, ensure_opset, find_linears, initializer, onnx_opset, prune, replace_linear
from .quant.nbits import MS_DOMAIN
from .quant.rtn import quantize_per_channel_int8


def _constants(model: ir.Model) -> dict[str, ir.Value]:
    return {
        "one": initializer(model, "w8a8.one", np.array(1.0, np.float32)),
        "zp": initializer(model, "w8a8.zp128", np.array(128, np.uint8)),  # activations and weights
        "inv127": initializer(model, "w8a8.inv127", np.array(1.0 / 127.0, np.float32)),
        "eps": initializer(model, "w8a8.eps", np.array(1e-8, np.float32)),
        "axes": initializer(model, "w8a8.axes", np.array([-1], np.int64)),
    }


def _quantize_activation(
    model: ir.Model, x: ir.Value, c: dict[str, ir.Value]
) -> tuple[list[ir.Node], ir.Value, ir.Value]:
    """Nodes producing (uint8 per-token-quantized x, its per-token scale)."""
    abs_ = ir.node("Abs", [x])
    if onnx_opset(model) >= 18:
        amax = ir.node("ReduceMax", [abs_.outputs[0], c["axes"]], attributes={"keepdims": 1})
    else:
        amax = ir.node("ReduceMax", [abs_.outputs[0]], attributes={"axes": [-1], "keepdims": 1})
    floor = ir.node("Max", [amax.outputs[0], c["eps"]])
    scale = ir.node("Mul", [floor.outputs[0], c["inv127"]])
    scaled = ir.node("Div", [x, scale.outputs[0]])
    quant = ir.node("QuantizeLinear", [scaled.outputs[0], c["one"], c["zp"]])
    return [abs_, amax, floor, scale, scaled, quant], quant.outputs[0], scale.outputs[0]


def quantize_w8a8(model: ir.Model, select: Callable[[Linear], bool] | None = None) -> int:
    """Rewrite every linear MatMul (every one `select` accepts) in place; return how many were converted."""
    linears = [lin for lin in find_linears(model) if select is None or select(lin)]
    if not linears:
        return 0
    c = _constants(model)
    quantized: dict[int, tuple[ir.Value, ir.Value]] = {}  # id(activation) -> (xq, per-token scale)
    for lin in track(linears, "quantize w8a8", "linear"):
        nodes = []
        if id(lin.activation) not in quantized:
            act_nodes, xq, xs = _quantize_activation(model, lin.activation, c)
            quantized[id(lin.activation)] = (xq, xs)
            nodes += act_nodes
        xq, xs = quantized[id(lin.activation)]
        q, w_scale = quantize_per_channel_int8(lin.weight)
        offset = (q.T.astype(np.int16) + 128).astype(np.uint8)  # exact: q in [-127, 127]
        wq = initializer(model, f"{lin.weight_name}.w8a8.q", np.ascontiguousarray(offset))
        ws = initializer(model, f"{lin.weight_name}.w8a8.scale", w_scale)
        mm = ir.node("MatMulIntegerToFloat", [xq, wq, c["one"], ws, c["zp"], c["zp"]], domain=MS_DOMAIN)
        out = ir.node("Mul", [mm.outputs[0], xs])
        nodes += [mm, out]
        if lin.bias is not None:
            out = ir.node("Add", [out.outputs[0], lin.bias])
            nodes.append(out)
        replace_linear(model, lin, nodes, out.outputs[0])
    ensure_opset(model, MS_DOMAIN)
    prune(model)
    return len(linears)
