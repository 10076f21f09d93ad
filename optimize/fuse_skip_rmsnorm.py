"""Residual Add + SimplifiedLayerNormalization -> com.microsoft::SkipSimplifiedLayerNormalization.

The residual sum is a pattern output too (the next residual Add reads it), so the fused op
returns both the normed value and the sum. Run after fuse_rmsnorm.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from kiln.optimize._common import add_opset


class SkipRmsNormFusion(pattern.RewriteRuleClassBase):
    def __init__(self):
        super().__init__("SkipRmsNorm")

    def pattern(self, op, x, skip, weight):
        total = op.Add(x, skip)
        normed = op.SimplifiedLayerNormalization(total, weight, _allow_other_attributes=True, _outputs=["normed"])
        return normed, total

    def check(self, context, x, skip, weight, normed, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.shape is None or skip.shape is None or len(x.shape) != 3 or x.shape != skip.shape:
            return result.fail("the Add is not a residual sum of two [B, T, D] tensors", x)
        if normed.producer().attributes.get_int("stash_type", 1) != 1:
            return result.fail("stash_type is not float32")
        return result

    def rewrite(self, op, x, skip, weight, normed, **_):
        epsilon = normed.producer().attributes.get_float("epsilon", 1e-5)
        out, _mean, _inv_std, total = op.SkipSimplifiedLayerNormalization(
            x, skip, weight, epsilon=epsilon, _domain="com.microsoft", _outputs=4
        )
        return out, total


def fuse_skip_rmsnorm(model: ir.Model) -> int:
    """Fuse every residual Add feeding an RMSNorm; returns how many."""
    # a fresh rule per call: its matcher keeps the last graph it matched in (fuse_rmsnorm._rules)
    count = pattern.RewriteRuleSet([SkipRmsNormFusion.rule()]).apply_to_model(model)
    if count:
        add_opset(model, "com.microsoft", 1)
    return count
