"""The MLP's activation after the fused gate/up projection -> kiln.SwiGLU (kiln/swiglu.py).

    gate, up = Split(x, [F, F], axis=-1);  y = Mul(silu(gate), up)     ->     y = kiln.SwiGLU(x)

with silu(gate) as Mul(gate, Sigmoid(gate)) (kiln's export and transformers' dynamo export both emit that),
or as one node: com.microsoft QuickGelu with alpha 1 (what ONNX Runtime makes of Sigmoid + Mul) or ONNX's
Swish with alpha 1. Operand orders of both Muls are matched commuted. The matcher refuses a match whose
Split outputs (or silu) have readers outside the pattern. Run after fuse_projections, which makes the Split;
which MatMul produced x (float, or a quantized kernel put in later) does not matter: the op reads x only.

At run time ONNX Runtime executed Split + QuickGelu + Mul: three kernels, a copy of [T, 2F] into two halves
and two more passes over them; kiln.SwiGLU reads x once and writes [T, F] once.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from kiln.contract import OP_DOMAIN
from kiln.optimize._common import add_opset, const_ints, is_last_axis, static_dim
from kiln.swiglu import OP_VERSION

_SILU_FORMS = ("Sigmoid", "QuickGelu", "Swish")


class SwiGluFusion(pattern.RewriteRuleClassBase):
    def __init__(self, silu: str):
        super().__init__(f"SwiGLU[{silu}]")
        self._silu = silu

    def pattern(self, op, x):
        gate, up = op.Split(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["gate", "up"])
        if self._silu == "Sigmoid":
            silu = op.Mul(gate, op.Sigmoid(gate))
        elif self._silu == "QuickGelu":
            silu = op.QuickGelu(gate, _domain="com.microsoft", _allow_other_attributes=True, _outputs=["silu"])
        else:
            silu = op.Swish(gate, _allow_other_attributes=True, _outputs=["silu"])
        return op.Mul(silu, up)

    def check(self, context, x, gate, **kwargs) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype != ir.DataType.FLOAT:
            return result.fail("the split value is not float32", x)
        reason = _unequal_halves(gate.producer(), x)
        if reason:
            return result.fail(reason, x)
        silu = kwargs.get("silu")
        if silu is not None:
            alpha = silu.producer().attributes.get_float("alpha", 1.0 if self._silu == "Swish" else 1.702)
            if alpha != 1.0:
                return result.fail(f"{self._silu} has alpha {alpha}, not 1 (it is not silu)", silu)
        return result

    def rewrite(self, op, x, **_):
        return op.SwiGLU(x, _domain=OP_DOMAIN, _version=OP_VERSION)


def _unequal_halves(split: ir.Node, x: ir.Value) -> str | None:
    """Why the Split is not two equal halves of x's last axis, or None when it is."""
    axis = split.attributes.get_int("axis", 0)
    if not is_last_axis(axis, x):
        return f"the Split is along axis {axis}, not the last"
    sizes_input = split.inputs[1] if len(split.inputs) > 1 else None
    if sizes_input is not None:
        sizes = const_ints(sizes_input)
        if sizes is None:
            return "the Split's sizes are not a constant"
    else:
        split_attr = split.attributes.get("split")
        sizes = list(split_attr.as_ints()) if split_attr is not None else None
    if sizes is not None:
        return None if len(sizes) == 2 and sizes[0] == sizes[1] else f"the Split's sizes {sizes} are not two halves"
    width = static_dim(x, -1)  # no sizes: even parts, equal only for an even width
    return None if width is not None and width % 2 == 0 else "the Split has no sizes and x's last dim is not even"


def fuse_swiglu(model: ir.Model) -> int:
    """Fuse every Split -> silu(gate) * up into kiln.SwiGLU; returns how many."""
    # a fresh rule set per call: a matcher keeps the last graph it matched in (fuse_rmsnorm._rules)
    rules = pattern.RewriteRuleSet([SwiGluFusion.rule(silu) for silu in _SILU_FORMS], commute=True)
    count = rules.apply_to_model(model)
    if count:
        add_opset(model, OP_DOMAIN, OP_VERSION)
    return count
