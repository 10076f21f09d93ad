"""Lower the backend-neutral engine graph (optimize/pipeline.py) for ONNX Runtime's CPU kernels.

Each step is a fusion into an op only ONNX Runtime (or kiln's CPU op library) runs:

- fuse_rmsnorm: RMSNorm -> SimplifiedLayerNormalization (ONNX Runtime's kernel), the final norm included
  (select_logits already gathered its rows);
- fuse_skip_rmsnorm: residual Add + that -> com.microsoft SkipSimplifiedLayerNormalization;
- fuse_swiglu: Split of the fused gate/up projection -> silu(gate) * up -> kiln.SwiGLU;
- pack_attention_inputs: kiln.PagedAttention reads the fused QKV projection in place.

Medusa heads (attach_medusa) and quantization run on the lowered graph: they are ONNX Runtime's alone
(--backend tensorrt refuses both), and attach_medusa finds the final norm as the fused op.
"""

from __future__ import annotations

import onnx_ir as ir
import onnxscript

from kiln.optimize.fuse_rmsnorm import fuse_rmsnorm
from kiln.optimize.fuse_skip_rmsnorm import fuse_skip_rmsnorm
from kiln.optimize.fuse_swiglu import fuse_swiglu
from kiln.optimize.pack_attention_inputs import pack_attention_inputs


def lower_for_onnxruntime(model: ir.Model) -> dict[str, int]:
    """Rewrite model in place for ONNX Runtime; returns how often each step fired."""
    counts = {
        "fuse_rmsnorm": fuse_rmsnorm(model),
        "fuse_skip_rmsnorm": fuse_skip_rmsnorm(model),  # the residual Adds feeding the fused norms
        "fuse_swiglu": fuse_swiglu(model),
    }
    onnxscript.optimizer.remove_unused_nodes(model)  # the norms' constants
    counts["pack_attention_inputs"] = pack_attention_inputs(model)
    return counts
