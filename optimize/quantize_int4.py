"""Pass: int4 round-to-nearest, group-wise along K with zero points -> com.microsoft::MatMulNBits.

Every linear layer is converted, the tied LM head included (the stock ORT quantizer leaves a
``MatMul(x, Transpose(embedding))`` in fp32; here the head gets its own quantized copy, int8
per channel by default; the SmolLM2 GGUF too keeps its embedding at Q8_0). AWQ-scaled weights
(kiln.calibration) are quantized the same way.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.export.progress import track
from kiln.quant_scheme import INT4_GROUP_SIZES

from .quant.graph import ensure_opset, find_linears, is_lm_head, linear_modules, prune, replace_linear
from .quant.nbits import MS_DOMAIN, make_matmul_nbits
from .quant.rtn import per_channel_as_groups, quantize_groupwise


def quantize_int4(model: ir.Model, group_size: int = 128, int4_lm_head: bool = False,
                  int8_modules: frozenset[str] = frozenset()) -> int:
    """Rewrite every linear MatMul in place; return how many were converted.

    The LM head (the linear feeding the logits output) gets int8 per channel unless
    int4_lm_head: on SmolLM2 an int4 head alone causes a third of int4-g32's perplexity loss.
    Linears computing a module named in int8_modules (an AWQ artifact's int8 fallback, e.g.
    model.layers.29.mlp.down_proj) get int8 per channel too; a name the graph lacks is an error.
    """
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {group_size}")
    linears = find_linears(model)
    int8 = {id(lin) for lin in linears if set(linear_modules(lin.matmul)) & int8_modules}
    missing = int8_modules - {m for lin in linears for m in linear_modules(lin.matmul)}
    if missing:
        raise ValueError(f"the int8 fallback names linears this graph does not have: {sorted(missing)[:3]}")
    for lin in track(linears, "quantize int4", "linear"):
        if (is_lm_head(lin) and not int4_lm_head) or id(lin) in int8:
            qw, name = per_channel_as_groups(lin.weight, group_size), f"{lin.weight_name}.int8"
        else:
            qw = quantize_groupwise(lin.weight, bits=4, group_size=group_size)
            name = f"{lin.weight_name}.int4g{group_size}"
        node = make_matmul_nbits(model, lin.activation, qw, name, lin.bias)
        replace_linear(model, lin, [node], node.outputs[0])
    if linears:
        ensure_opset(model, MS_DOMAIN)
        prune(model)
    return len(linears)
