"""The mixture-of-experts MLP of the reference model, traced straight into kiln.MoE.

transformers' MoE blocks loop over the experts a batch hit (``nonzero``, ``index_add_``): data-dependent control
flow that a trace either specialises to the example's routing or cannot follow at all. A fusion pass that had to
recognise the block after tracing would match whatever the exporter made of that loop. So the reference model's
sparse MLP calls one torch custom op, ``kiln::moe``, whose eager implementation is the contract's arithmetic in
torch (what calibration runs), whose fake implementation gives the shape (what the trace sees), and whose ONNX
translation (``MOE_TRANSLATION``, handed to torch.onnx.export) is the single node kiln.MoE with the stacked expert
weights as initializers. The op's contract and numpy spec are kiln/moe.py.

Expert weights are stacked per layer: ``mlp.experts.gate_up_proj`` [E, 2F, D] (each expert's gate rows, then its up
rows) and ``mlp.experts.down_proj`` [E, D, F] (export/moe_weights.py builds them from per-expert checkpoints).
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
import torch.nn.functional as F
from torch import nn

from kiln.contract import OP_DOMAIN
from kiln.moe import OP_TYPE, OP_VERSION
from kiln.spec import ModelSpec


def _moe_schema() -> onnx.defs.OpSchema:
    """kiln.MoE's signature for the exporter's graph builder (the contract itself is kiln/moe.py)."""
    tensor = onnx.defs.OpSchema.FormalParameter
    attribute = onnx.defs.OpSchema.Attribute
    return onnx.defs.OpSchema(
        OP_TYPE, OP_DOMAIN, OP_VERSION,
        inputs=[tensor(name, "T") for name in ("x", "router", "gate_up", "down")],
        outputs=[tensor("y", "T")],
        type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[attribute("top_k", onnx.defs.OpSchema.AttrType.INT, "experts per token"),
                    attribute("norm_topk_prob", onnx.defs.OpSchema.AttrType.INT, "renormalise the chosen weights")],
    )


_MOE_NODE = onnxscript.values.Op(onnxscript.values.Opset(OP_DOMAIN, OP_VERSION), OP_TYPE, _moe_schema())


@torch.library.custom_op("kiln::moe", mutates_args=())
def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
        norm_topk_prob: bool) -> torch.Tensor:
    """kiln.MoE in torch: x [..., D] -> [..., D] (kiln/moe.py)."""
    rows = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(rows @ router.T, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(rows)
    for expert in torch.unique(experts).tolist():
        tokens, slots = torch.nonzero(experts == expert, as_tuple=True)
        act = expert_activations(rows[tokens], gate_up[expert])
        out.index_add_(0, tokens, weights[tokens, slots, None] * (act @ down[expert].T))
    return out.reshape(x.shape)


def expert_activations(rows: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of one expert (gate_up [2F, D]: gate rows, then up rows) on its rows [n, D]: what its down
    projection reads (kiln::moe's arithmetic; calibration measures the down inputs with it)."""
    hidden = rows @ gate_up.T
    f = gate_up.shape[0] // 2
    return F.silu(hidden[:, :f]) * hidden[:, f:]


@moe.register_fake
def _moe_shape(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
               norm_topk_prob: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _moe_onnx(x, router, gate_up, down, top_k: int, norm_topk_prob: bool):  # noqa: ANN001, ANN202 (onnxscript values)
    return _MOE_NODE(x, router, gate_up, down, top_k=top_k, norm_topk_prob=int(norm_topk_prob))


# torch.onnx.export(custom_translation_table=...): the custom op becomes one kiln.MoE node.
MOE_TRANSLATION = {torch.ops.kiln.moe.default: _moe_onnx}


class Experts(nn.Module):
    """The routed experts' stacked weights (parameter names as transformers >= 5 keeps them)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, d, f = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))


class SharedExpert(nn.Module):
    """Qwen2-MoE's dense expert: a SwiGLU MLP of its own width, plain ops (the dense MLP passes apply to it)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, f = spec.hidden_size, spec.shared_expert_intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Router + routed experts (kiln::moe), plus the sigmoid-gated shared expert where the family has one."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.top_k = spec.experts_per_token
        self.norm_topk_prob = spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec)
        self.has_shared_expert = spec.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = SharedExpert(spec)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = moe(x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, self.top_k,
                self.norm_topk_prob)
        if self.has_shared_expert:  # static: fixed by the spec
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
