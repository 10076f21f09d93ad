"""RMSNorm subgraph -> SimplifiedLayerNormalization (ONNX Runtime's RMSNorm kernel).

    x * 1/sqrt(mean(x^2) + eps) * weight

with x^2 as Pow(x, 2) or Mul(x, x), 1/sqrt as Reciprocal(Sqrt) times x or x / Sqrt, and the
weight a constant [D] multiplied on either side (operand orders are matched commuted).
ONNX Runtime registers SimplifiedLayerNormalization in the default domain (opset >= 1).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from kiln.optimize._common import const_float, const_ints

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


class RmsNormFusion(pattern.RewriteRuleClassBase):
    def __init__(self, square: str, divide: bool):
        super().__init__(f"RmsNorm[{square},{'Div' if divide else 'Reciprocal'}]")
        self._square, self._divide = square, divide

    def pattern(self, op, x, axes, epsilon, weight):
        square = op.Pow(x, 2.0) if self._square == "Pow" else op.Mul(x, x)
        rms = op.Sqrt(op.Add(op.ReduceMean(square, axes, keepdims=1), epsilon))
        normed = op.Div(x, rms) if self._divide else op.Mul(x, op.Reciprocal(rms))
        return op.Mul(normed, weight)

    def check(self, context, x, axes, epsilon, weight, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype not in _FLOATS:
            return result.fail("input is not float32/float16", x)
        rank = len(x.shape) if x.shape is not None else None
        if const_ints(axes) not in ([-1], None if rank is None else [rank - 1]):
            return result.fail("ReduceMean is not over the last axis", axes)
        if const_float(epsilon) is None:
            return result.fail("epsilon is not a constant scalar", epsilon)
        if ir.convenience.get_const_tensor(weight) is None or weight.shape is None or len(weight.shape) != 1:
            return result.fail("weight is not a constant vector", weight)
        return result

    def rewrite(self, op, x, epsilon, weight, **_):
        return op.SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=const_float(epsilon), stash_type=1)


def _rules() -> pattern.RewriteRuleSet:
    """A fresh rule set per call: a rule's matcher keeps the last graph it matched in, so a module-level set would
    hold an engine's whole graph (and its quantized weights) alive after the build drops it."""
    return pattern.RewriteRuleSet(
        [RmsNormFusion.rule(square, divide) for square in ("Pow", "Mul") for divide in (False, True)],
        commute=True,
    )


def fuse_rmsnorm(model: ir.Model) -> int:
    """Fuse every RMSNorm; returns how many."""
    return _rules().apply_to_model(model)
