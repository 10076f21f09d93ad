"""The optimizer pipeline: raw exported graph -> backend-neutral engine graph (kiln/contract.py).

Every pass here emits standard ONNX ops and kiln.PagedAttention, which both backends run; what only one
backend runs is its lowering's (optimize/lower_onnxruntime.py, optimize/lower_tensorrt.py), so nothing is
fused for one backend and unfused for the other."""

from __future__ import annotations

import onnx_ir as ir
import onnxscript
from onnx_ir.passes.common import IdentityEliminationPass
from onnxscript.rewriter import rewrite
from onnxscript.rewriter.rules.common._basic_rules import ReshapeReshape, TransposeIdentity, TransposeTranspose

from kiln import contract
from kiln.optimize.flatten_inputs import flatten_inputs
from kiln.optimize.fuse_attention import AttentionConfig, fuse_attention
from kiln.optimize.fuse_projections import fuse_projections
from kiln.optimize.select_logits import select_logits


def _cleanup_rules() -> list:
    """onnxscript's transpose/reshape rules, made fresh per call: its module-level instances keep the last graph they
    matched in (a matcher's state), which would hold an engine's graph and weights alive after the build drops it."""
    return [TransposeTranspose.rule(), TransposeIdentity.rule(), ReshapeReshape.rule()]


DEFAULT_ATTENTION = AttentionConfig()  # frozen: one shared default is safe


def optimize_model(model: ir.Model, attention: AttentionConfig = DEFAULT_ATTENTION) -> dict[str, int]:
    """Run the backend-neutral passes in order on model (in place); returns how often each fired."""
    counts = {
        "flatten_inputs": flatten_inputs(model),
        "fuse_attention": fuse_attention(model, attention),
        "select_logits": select_logits(model),
        "fuse_projections": fuse_projections(model),  # after fuse_attention: it matches the separate q/k/v
    }
    cleanup(model)
    _order_io(model)
    return counts


def cleanup(model: ir.Model) -> None:
    """Drop dead code (the old mask computation) and the transposes the fusions cancelled; the
    Identities a cancelled Transpose pair leaves go too, so the Reshapes around them collapse."""
    onnxscript.optimizer.remove_unused_nodes(model)
    rewrite(model, pattern_rewrite_rules=_cleanup_rules())
    IdentityEliminationPass()(model)
    rewrite(model, pattern_rewrite_rules=_cleanup_rules())
    onnxscript.optimizer.remove_unused_nodes(model)


def _order_io(model: ir.Model) -> None:
    """Graph inputs/outputs in kiln/contract.py order (the layers' pools last, by layer)."""
    order = [contract.INPUT_IDS, contract.POSITION_IDS, contract.QUERY_START_LOC, contract.SEQ_LENS,
             contract.BLOCK_TABLES, contract.LOGITS_INDICES]

    def key(value: ir.Value):
        name = value.name or ""
        if name in order:
            return (order.index(name), 0)
        if name == contract.LOGITS:
            return (-1, 0)
        layer = name.rsplit(".", 1)[-1]
        return (len(order), int(layer) if layer.isdigit() else 1 << 30)

    for values in (model.graph.inputs, model.graph.outputs):
        ordered = sorted(values, key=key)
        values.clear()
        values.extend(ordered)
