"""kiln.MoE (domain "kiln", version 1): a sparse mixture-of-experts SwiGLU MLP, the contract and its executable spec.

The ONNX Runtime CPU kernel (runtime/ops/moe.cc) is tested against `moe_ref` (float32 experts), `moe_q4_1_ref`
(Q4_1 experts) and kiln/moe_gguf.py's `moe_gguf_ref` (a GGUF file's expert blocks); the exporter's torch op
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

Q4_1 experts (the same op, its expert inputs typed uint8, two more inputs), in one of two layouts named by the
string attribute ``layout``:
  layout "blocks" (the default; every graph before the build's last step, and engines of op-library ABI < 11):
  gate_up     uint8   [E, 2F, D/2]         llama.cpp's Q4_1 numbers per block of 32 inputs: w = m + q * d; a block's
  down        uint8   [E, D, F/2]          16 bytes hold element j in byte j's low nibble, element j + 16 in its high
  gate_up_dm  float16 [E, 2F, D/32, 2]     one (like a GGUF block_q4_1's qs); dm the blocks' (d, m)
  down_dm     float16 [E, D, F/32, 2]
  layout "records" (what an engine stores, ABI 11: the kernel's own layout, read where ONNX Runtime maps it):
  gate_up     uint8   [E, 2F/16, D/32, 320]  expert e's gate_up [2F, D] as kiln.MatMulQ4_1's records (16 output
  down        uint8   [E, D/16, F/32, 320]   channels per block of 32 inputs, d and m inside), expert after expert
  gate_up_dm  float16 [E, 2F, 0]             no numbers, as MatMulQ4_1's records form: their shapes name the rows
  down_dm     float16 [E, D, 0]
D and F multiples of 32, so every expert's rows are whole 16-channel groups and expert e's records start at byte
e * rows / 16 * K / 32 * 320 of its stack. The kernel repacks constant blocks into those records once, at session
load, into memory of its own; records it reads where the tensor lies (unaligned loads: anywhere works, and the
engine writer puts them on page boundaries). `q4_1_experts_to_records` / `q4_1_experts_from_records` convert
between the layouts bit for bit as the kernel's packing does.
The optional float attribute ``centre`` is kiln.MatMulQ4_1's (absent: 7.5; 8 for a Q4_0 file's experts; ABI 15),
for both projections of every expert; other experts take none.
Each expert's two projections are kiln.MatMulQ4_1's arithmetic (kiln/matmul_q4_1.py): the
projection's input rows (the token for gate/up, silu(gate) * up in float32 for down) quantized per block of 32 to
int8 with exact float block sums, integer dots against the nibbles: `moe_q4_1_ref`. The kernel sums in float32 where
the spec sums in float64, so they agree to float32 rounding, as kiln.MatMulQ4_1 and its spec do; one more difference
is possible: the down projection's int8 inputs are rounded from silu(gate) * up, which the kernel holds in float32
from float32 sums, so an element within float32 rounding of a half int8 step can land one step away from the
spec's (that element's step times its down column, ~1/127 of its term; the tests' cases have none).

GGUF experts (the same op, its expert inputs uint8 and three more attributes; kiln/moe_gguf.py specifies them):
  gate_up     uint8   [E, 2F, row bytes]   a GGUF file's expert blocks as they are (ffn_gate_exps' rows, then
  down        uint8   [E, D, row bytes]    ffn_up_exps'; ffn_down_exps), no dm inputs
  gate_type, up_type, down_type   int      their ggml types (kiln.MatMulGGUF's, each its own)
  int8_activations                int      optional (absent: 1), as kiln.MatMulGGUF's
Each projection is kiln.MatMulGGUF's arithmetic on that activation path (kiln/gguf_int8.py, kiln/matmul_gguf.py):
`moe_gguf_ref`.

Per row: p = softmax(x @ router^T) over all E experts; the top_k largest p are chosen (equal p: the lower expert
index first); w = the chosen p, renormalised to sum 1 when norm_topk_prob; y = sum_j w_j * expert_{e_j}(x) with
expert_e(x) = down_e @ (silu(gate_e @ x) * (up_e @ x)).

One routing rule covers the families: Mixtral's softmax over the top-k logits equals softmax over all then
renormalise (norm_topk_prob=1); Qwen2/3-MoE take norm_topk_prob from the config; OLMoE does not renormalise.
A shared expert (Qwen2-MoE) is a dense MLP beside the op, left to the graph's ordinary ops and passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.contract import OP_DOMAIN
from kiln.matmul_q4_1 import (
    BLOCKS,
    CENTRE,
    CENTRE_ATTRIBUTE,
    LAYOUT,
    RECORD_BYTES,
    RECORDS,
    Q4_1Weights,
    check_centre,
    check_layout,
    matmul_q4_1_ref,
)
from kiln.op_models import single_node_model

if TYPE_CHECKING:
    from onnx import ModelProto

OP_TYPE = "MoE"
OP_VERSION = 1
GROUP = 16  # output channels of a record (kiln.MatMulQ4_1's)


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


Q4_BLOCK = 32


def pack_q4_1_experts(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nibbles uint8 [E, rows, K/2], dm float16 [E, rows, K/32, 2]) from q uint8 [E, rows, K] in [0, 15] and the
    blocks' d, m float16 [E, rows, K/32]."""
    e, rows, k = q.shape
    if k % Q4_BLOCK or q.dtype != np.uint8 or q.max(initial=0) > 15:
        raise ValueError(f"q must be uint8 [E, rows, K] with K a multiple of {Q4_BLOCK} and values < 16, "
                         f"got {q.dtype} {list(q.shape)}")
    blocks = q.reshape(e, rows, k // Q4_BLOCK, Q4_BLOCK)
    nibbles = blocks[..., :16] | (blocks[..., 16:] << 4)
    dm = np.stack([d.astype(np.float16), m.astype(np.float16)], axis=-1)
    return nibbles.reshape(e, rows, k // 2), dm


def unpack_q4_1_experts(nibbles: np.ndarray, dm: np.ndarray) -> np.ndarray:
    """The float32 weights [E, rows, K] Q4_1 experts hold: m + q * d in float32, as llama.cpp dequantizes."""
    e, rows, half = nibbles.shape
    blocks = nibbles.reshape(e, rows, -1, 16)
    q = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1).astype(np.float32)
    d, m = dm[..., 0].astype(np.float32), dm[..., 1].astype(np.float32)
    out: np.ndarray = (m[..., None] + q * d[..., None]).reshape(e, rows, 2 * half)
    return out


def q4_1_expert(nibbles: np.ndarray, dm: np.ndarray, expert: int) -> Q4_1Weights:
    """Expert `expert` of a Q4_1 stack (nibbles [E, rows, K/2], dm [E, rows, K/32, 2]) as kiln.MatMulQ4_1's weights."""
    blocks = nibbles[expert].reshape(nibbles.shape[1], -1, 16)
    q = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1).reshape(nibbles.shape[1], -1)
    return Q4_1Weights(np.ascontiguousarray(q), np.ascontiguousarray(dm[expert, ..., 0]),
                       np.ascontiguousarray(dm[expert, ..., 1]))


def q4_1_experts_to_records(nibbles: np.ndarray, dm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A stack's blocks (nibbles [E, rows, K/2], dm [E, rows, K/32, 2]) as the records layout: (records uint8
    [E, rows/16, K/32, 320], dm float16 [E, rows, 0]), converted one expert at a time."""
    e, rows, half = nibbles.shape
    if rows % GROUP or half % (Q4_BLOCK // 2) or dm.shape != (e, rows, half // (Q4_BLOCK // 2), 2):
        raise ValueError(f"Q4_1 experts must be nibbles [E, rows, K/2] with rows a multiple of {GROUP} and dm "
                         f"[E, rows, K/32, 2], got {list(nibbles.shape)} and {list(dm.shape)}")
    records = np.empty((e, rows // GROUP, 2 * half // Q4_BLOCK, RECORD_BYTES), np.uint8)
    for expert in range(e):
        records[expert] = q4_1_expert(nibbles, dm, expert).pack_records()[0]
    return records, np.zeros((e, rows, 0), np.float16)


def q4_1_records_expert(records: np.ndarray, dm: np.ndarray, expert: int) -> Q4_1Weights:
    """Expert `expert` of a stack in the records layout (records [E, rows/16, K/32, 320], dm [E, rows, 0])."""
    e = records.shape[0] if records.ndim == 4 else -1
    if records.ndim != 4 or dm.shape != (e, records.shape[1] * GROUP, 0):
        raise ValueError(f"Q4_1 records must be uint8 [E, rows/16, K/32, {RECORD_BYTES}] with dm float16 [E, rows, 0], "
                         f"got {list(records.shape)} and {list(dm.shape)}")
    return Q4_1Weights.unpack_records(records[expert], dm[expert])


def q4_1_experts_from_records(records: np.ndarray, dm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The blocks (nibbles [E, rows, K/2], dm [E, rows, K/32, 2]) of a stack in the records layout."""
    experts = [q4_1_records_expert(records, dm, expert) for expert in range(records.shape[0])]
    return pack_q4_1_experts(np.stack([w.q for w in experts]), np.stack([w.d for w in experts]),
                             np.stack([w.m for w in experts]))


def _q4_1_expert_as(layout: str, stack: tuple[np.ndarray, np.ndarray], expert: int) -> Q4_1Weights:
    return q4_1_records_expert(*stack, expert) if layout == RECORDS else q4_1_expert(*stack, expert)


def moe_q4_1_ref(x: np.ndarray, router: np.ndarray, gate_up: tuple[np.ndarray, np.ndarray],  # noqa: PLR0913
                 down: tuple[np.ndarray, np.ndarray], *, top_k: int, norm_topk_prob: bool,
                 layout: str = BLOCKS, centre: float = CENTRE) -> np.ndarray:
    """The op's output for Q4_1 experts gate_up = (nibbles or records, dm), down = (nibbles or records, dm) in
    `layout`: each projection kiln.MatMulQ4_1's with the node's `centre` (`matmul_q4_1_ref`: int8 activations,
    float64 accumulation); float32 [..., D]."""
    x = np.asarray(x, np.float32)
    check_layout(layout)
    check_centre(centre)
    # the float stacks' shapes, without their memory
    shapes = [(w.shape[0], w.shape[1] * GROUP, w.shape[2] * Q4_BLOCK) if layout == RECORDS
              else (*w.shape[:2], 2 * w.shape[2]) for w, _ in (gate_up, down)]
    gate_up_shape, down_shape = (np.broadcast_to(np.uint8(0), shape) for shape in shapes)
    check_moe_shapes(x, router, gate_up_shape, down_shape, top_k)
    rows = x.reshape(-1, x.shape[-1])
    experts, weights = route_ref(rows, router, top_k, norm_topk_prob)
    f = shapes[0][1] // 2
    y = np.zeros(rows.shape, np.float64)
    for expert in np.unique(experts):
        tokens, slots = np.nonzero(experts == expert)
        hidden = matmul_q4_1_ref(rows[tokens], *_q4_1_expert_as(layout, gate_up, int(expert)).pack(), centre=centre)
        hidden = hidden.astype(np.float64)
        act = (hidden[:, :f] / (1.0 + np.exp(-np.clip(hidden[:, :f], -700, 700))) * hidden[:, f:]).astype(np.float32)
        out = matmul_q4_1_ref(act, *_q4_1_expert_as(layout, down, int(expert)).pack(), centre=centre)
        out = out.astype(np.float64)
        y[tokens] += weights[tokens, slots, None] * out
    result: np.ndarray = y.astype(np.float32).reshape(x.shape)
    return result


def make_single_op_model(top_k: int, norm_topk_prob: bool, rank: int = 2, q4_1: bool = False,  # noqa: PLR0913
                         layout: str = BLOCKS, centre: float | None = None) -> ModelProto:
    """A one-node ONNX model y = kiln.MoE(x, router, gate_up, down[, gate_up_dm, down_dm]), every input a graph
    input with symbolic dims (Q4_1 experts in `layout` with q4_1, and a centre attribute when given); for tests and
    benchmarks."""
    from onnx import TensorProto, helper  # compile-time dependency only

    lead = [f"t{i}" for i in range(rank - 1)]
    names = ["x", "router", "gate_up", "down"] + (["gate_up_dm", "down_dm"] if q4_1 else [])
    extra: dict[str, Any] = {LAYOUT: check_layout(layout)} if q4_1 and layout != BLOCKS else {}
    attributes = {**extra, CENTRE_ATTRIBUTE: centre} if centre is not None else extra
    node = helper.make_node(OP_TYPE, names, ["y"], domain=OP_DOMAIN, top_k=top_k, norm_topk_prob=int(norm_topk_prob),
                            **attributes)
    expert_type = TensorProto.UINT8 if q4_1 else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, "D"]),
              helper.make_tensor_value_info("router", TensorProto.FLOAT, ["E", "D"]),
              helper.make_tensor_value_info("gate_up", expert_type, None if extra else ["E", "F2", "Dq"]),
              helper.make_tensor_value_info("down", expert_type, None if extra else ["E", "D", "Fq"])]
    if q4_1:
        inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT16, None) for name in names[4:]]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, "D"])]
    return single_node_model(node, "moe", inputs, outputs, OP_VERSION)

