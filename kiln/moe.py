"""kiln.MoE (domain "kiln", version 1): a sparse mixture-of-experts SwiGLU MLP, the contract and its executable spec.

The ONNX Runtime CPU kernel (runtime/ops/moe.cc) is tested against `moe_ref`; the exporter's torch op
(export/moe.py) computes the same thing for calibration and tracing.

Inputs
  x        float32 [..., D]      the tokens of the packed batch (any leading shape; each row routes alone)
  router   float32 [E, D]        router logits = x @ router^T
  gate_up  float32 [E, 2F, D]    expert e's gate rows [0, F) then its up rows [F, 2F), as a Linear stores them
  down     float32 [E, D, F]     expert e's down projection
Attributes
  top_k           int in [1, E]   experts per token
  norm_topk_prob  int 0 | 1       1: the chosen experts' probabilities are divided by their sum
Output
  y        float32 [..., D]

Per row: p = softmax(x @ router^T) over all E experts; the top_k largest p are chosen (equal p: the lower expert
index first); w = the chosen p, renormalised to sum 1 when norm_topk_prob; y = sum_j w_j * expert_{e_j}(x) with
expert_e(x) = down_e @ (silu(gate_e @ x) * (up_e @ x)).

One routing rule covers the families: Mixtral's softmax over the top-k logits equals softmax over all then
renormalise (norm_topk_prob=1); Qwen2/3-MoE take norm_topk_prob from the config; OLMoE does not renormalise.
A shared expert (Qwen2-MoE) is a dense MLP beside the op, left to the graph's ordinary ops and passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kiln.contract import OP_DOMAIN

if TYPE_CHECKING:
    from onnx import ModelProto

OP_TYPE = "MoE"
OP_VERSION = 1


def check_moe_shapes(x: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, top_k: int) -> None:
    """Every shape against the others; a mismatch raises ValueError naming the input."""
    if x.ndim < 1:
        raise ValueError("x must be [..., D], got a scalar")
    d = x.shape[-1]
    if router.ndim != 2 or router.shape[1] != d:
        raise ValueError(f"router must be [E, D={d}], got {list(router.shape)}")
    e = router.shape[0]
    if gate_up.ndim != 3 or gate_up.shape[0] != e or gate_up.shape[2] != d or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [E={e}, 2F, D={d}], got {list(gate_up.shape)}")
    f = gate_up.shape[1] // 2
    if down.shape != (e, d, f):
        raise ValueError(f"down must be [E={e}, D={d}, F={f}], got {list(down.shape)}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, E={e}], got {top_k}")


def route_ref(x: np.ndarray, router: np.ndarray, top_k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """The routing of x [T, D]: (experts int64 [T, top_k], weights float64 [T, top_k]), best expert first."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # stable: equal p keep the lower index first
    weights = np.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts, weights


def moe_ref(x: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, *, top_k: int,
            norm_topk_prob: bool) -> np.ndarray:
    """The op's output, computed in float64; float32 [..., D]."""
    x = np.asarray(x, np.float32)
    check_moe_shapes(x, router, gate_up, down, top_k)
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    experts, weights = route_ref(rows, router, top_k, norm_topk_prob)
    f = gate_up.shape[1] // 2
    y = np.zeros_like(rows)
    for expert in np.unique(experts):
        tokens, slots = np.nonzero(experts == expert)
        hidden = rows[tokens] @ gate_up[expert].astype(np.float64).T
        gate, up = hidden[:, :f], hidden[:, f:]
        act = gate / (1.0 + np.exp(-np.clip(gate, -700, 700))) * up
        y[tokens] += weights[tokens, slots, None] * (act @ down[expert].astype(np.float64).T)
    out: np.ndarray = y.astype(np.float32).reshape(x.shape)
    return out


def make_single_op_model(top_k: int, norm_topk_prob: bool, rank: int = 2) -> ModelProto:
    """A one-node ONNX model y = kiln.MoE(x, router, gate_up, down), every input a graph input with symbolic
    dims; for tests and benchmarks."""
    from onnx import TensorProto, helper  # compile-time dependency only

    lead = [f"t{i}" for i in range(rank - 1)]
    node = helper.make_node(OP_TYPE, ["x", "router", "gate_up", "down"], ["y"], domain=OP_DOMAIN,
                            top_k=top_k, norm_topk_prob=int(norm_topk_prob))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, "D"]),
              helper.make_tensor_value_info("router", TensorProto.FLOAT, ["E", "D"]),
              helper.make_tensor_value_info("gate_up", TensorProto.FLOAT, ["E", "F2", "D"]),
              helper.make_tensor_value_info("down", TensorProto.FLOAT, ["E", "D", "F"])]
    graph = helper.make_graph([node], "moe", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, "D"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(OP_DOMAIN, OP_VERSION)])
    model.ir_version = 8
    return model
