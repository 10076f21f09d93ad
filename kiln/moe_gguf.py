"""kiln.MoE's GGUF experts: a GGUF file's expert blocks as they are, and their executable spec `moe_gguf_ref`.

The op's contract is kiln/moe.py's; this variant types its expert inputs uint8 and names the blocks' ggml types:

  gate_up  uint8 [E, 2F, max(gate row bytes, up row bytes)]  expert e's gate rows [0, F) then its up rows [F, 2F),
                                                              each row its blocks over D from the row's start
                                                              (a shorter row zero-padded: gate and up may differ)
  down     uint8 [E, D, down row bytes]                      each row its blocks over F
Attributes (beside top_k and norm_topk_prob)
  gate_type, up_type, down_type   int, all three: GGUF type ids of kiln.MatMulGGUF's (Q4_0, Q5_0, Q5_1, Q8_0, Q4_K,
                                  Q5_K, Q6_K); a Q4_K_M file's experts are Q4_K gate/up and Q4_K or Q6_K down by layer
  int8_activations                int, optional (absent: 1): as kiln.MatMulGGUF's. 1: int8 activations, types with
                                  an int8 kernel only (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K); 0: float32 activations
  layout                          string, optional (absent: "blocks"): "records" (int8 activations; gate and up of
                                  one type and down, each Q4_K, Q5_K, Q6_K or Q8_0; F and D multiples of 256 and
                                  16) holds each expert's kiln.MatMulGGUF records (kiln/gguf_records.py), expert
                                  after expert: gate_up uint8 [E, 2F / 16, D / 256, record bytes] (gate's groups,
                                  then up's), down uint8 [E, D / 16, F / 256, record bytes]; op-library ABI 12 (14
                                  for Q5_K, Q8_0)
No gate_up_dm / down_dm inputs.

Per row the routing is moe_ref's; each chosen expert's projections are kiln.MatMulGGUF's arithmetic. With int8
activations (`matmul_gguf_int8_ref`, what the dense `gguf` engines run) the token is quantized for gate and for up,
silu(gate) * up in float32 for down; the kernel sums each projection in float32 where this spec sums in float64, and
the down projection's int8 inputs are rounded from float32 values the kernel computed with float32 sums, so the two
agree within float32 rounding (an element within rounding of a half int8 step can land one step away, as for the
Q4_1 experts: kiln/moe.py says what that costs). With float32 activations (`matmul_gguf_ref`, `gguf-exact`) each
projection is x @ dequantize(W)^T: the file's weights, to float32 rounding. With records each projection is
`matmul_records_ref` (activations per block of 32, as the dense `gguf` engines' records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kiln.contract import OP_DOMAIN
from kiln.gguf_blocks import GgmlType, dequantize, row_bytes
from kiln.gguf_int8 import INT8_KINDS, matmul_gguf_int8_ref
from kiln.gguf_records import (
    BLOCKS,
    LAYOUT,
    RECORD_KINDS,
    RECORDS,
    SUPER,
    matmul_records_ref,
    pack_records,
    unpack_records,
)
from kiln.matmul_gguf import INT8_ATTRIBUTE, matmul_gguf_ref
from kiln.matmul_q4_1 import GROUP
from kiln.moe import OP_TYPE, OP_VERSION, check_moe_shapes, route_ref
from kiln.op_models import single_node_model

if TYPE_CHECKING:
    from onnx import ModelProto

TYPE_ATTRIBUTES = ("gate_type", "up_type", "down_type")


def expert_kind(value: int, what: str, int8_activations: bool = True) -> GgmlType:
    """The type of an expert stack, one kiln.MoE multiplies on that activation path; ValueError naming it and the
    supported ones otherwise."""
    supported = INT8_KINDS if int8_activations else frozenset(GgmlType)
    try:
        kind = GgmlType(int(value))
    except ValueError:
        kind = None
    if kind is None or kind not in supported:
        kinds = ", ".join(f"{k.name} ({k.value})" for k in sorted(supported))
        path = "int8" if int8_activations else "float32"
        raise ValueError(f"{what} has ggml type {value}, which kiln.MoE's GGUF experts with {path} activations have "
                         f"no kernel for; supported: {kinds}")
    return kind


@dataclass(frozen=True)
class GgufExperts:
    """One layer's experts as the op takes them (see the module docstring)."""

    gate_up: np.ndarray  # uint8 [E, 2F, row bytes]
    down: np.ndarray  # uint8 [E, D, row bytes]
    gate_type: GgmlType
    up_type: GgmlType
    down_type: GgmlType

    @property
    def types(self) -> tuple[GgmlType, GgmlType, GgmlType]:
        return self.gate_type, self.up_type, self.down_type

    @property
    def dims(self) -> tuple[int, int, int]:
        """(E, D, F)."""
        e, d = self.down.shape[:2]
        return e, d, self.gate_up.shape[1] // 2

    def projection(self, expert: int, which: str) -> tuple[np.ndarray, GgmlType]:
        """Expert `expert`'s gate, up or down rows as uint8 [rows, row bytes] of its type (padding cut)."""
        _, d, f = self.dims
        if which == "down":
            return self.down[expert], self.down_type
        kind = self.gate_type if which == "gate" else self.up_type
        rows = self.gate_up[expert, :f] if which == "gate" else self.gate_up[expert, f:]
        return np.ascontiguousarray(rows[:, :row_bytes(kind, d)]), kind

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """(gate_up float32 [E, 2F, D], down float32 [E, D, F]): the file's weights, llama.cpp's decoding."""
        e, d, f = self.dims
        gate_up = np.stack([np.concatenate([dequantize(*self.projection(j, "gate")),
                                            dequantize(*self.projection(j, "up"))]) for j in range(e)])
        down = np.stack([dequantize(*self.projection(j, "down")) for j in range(e)])
        return gate_up, down


def gguf_experts(gate: np.ndarray, up: np.ndarray, down: np.ndarray, types: tuple[int, int, int],
                 int8_activations: bool = True) -> GgufExperts:
    """The op's inputs from a file's three stacks, uint8 [E, F, gate/up row bytes] and [E, D, down row bytes] (the
    bytes as ffn_gate_exps / ffn_up_exps / ffn_down_exps hold them), checked against each other and their types."""
    names = ("gate", "up", "down")
    gate_kind, up_kind, down_kind = (expert_kind(t, name, int8_activations) for t, name in zip(types, names,
                                                                                               strict=True))
    for name, stack in zip(names, (gate, up, down), strict=True):
        if stack.ndim != 3 or stack.dtype != np.uint8:
            raise ValueError(f"{name} experts must be uint8 [E, rows, row bytes], "
                             f"got {stack.dtype} {list(stack.shape)}")
    e, f, _ = gate.shape
    d = down.shape[1]
    if up.shape[:2] != (e, f) or down.shape[0] != e:
        raise ValueError(f"expert stacks disagree: gate {list(gate.shape)}, up {list(up.shape)}, "
                         f"down {list(down.shape)}")
    for name, stack, kind, k in (("gate", gate, gate_kind, d), ("up", up, up_kind, d), ("down", down, down_kind, f)):
        if stack.shape[2] != row_bytes(kind, k):
            raise ValueError(f"{name} experts' rows are {stack.shape[2]} bytes, {kind.name} rows of {k} weights are "
                             f"{row_bytes(kind, k)}")
    width = max(gate.shape[2], up.shape[2])
    gate_up = np.zeros((e, 2 * f, width), np.uint8)
    gate_up[:, :f, :gate.shape[2]] = gate
    gate_up[:, f:, :up.shape[2]] = up
    return GgufExperts(gate_up, np.ascontiguousarray(down), gate_kind, up_kind, down_kind)


def records_packable(types: tuple[int, int, int], int8_activations: bool, d: int, f: int) -> bool:
    """Whether GGUF experts of these types and dims may be held as records (layout "records")."""
    gate, up, down = (GgmlType(int(t)) for t in types)
    return (int8_activations and gate == up and gate in RECORD_KINDS and down in RECORD_KINDS
            and d % SUPER == 0 and f % SUPER == 0 and d % GROUP == 0 and f % GROUP == 0)


def experts_to_records(gate_up: np.ndarray, down: np.ndarray, types: tuple[int, int, int]) -> tuple[np.ndarray,
                                                                                                     np.ndarray]:
    """The op's blocks (gate_up [E, 2F, row bytes], down [E, D, row bytes]) as its records, expert by expert."""
    gate_kind, _, down_kind = types
    return (np.stack([pack_records(expert, gate_kind) for expert in gate_up]),
            np.stack([pack_records(expert, down_kind) for expert in down]))


def experts_from_records(gate_up: np.ndarray, down: np.ndarray, types: tuple[int, int, int]) -> tuple[np.ndarray,
                                                                                                       np.ndarray]:
    """The op's records back as its blocks, the file's bytes bit for bit."""
    gate_kind, _, down_kind = types
    return (np.stack([unpack_records(expert, gate_kind) for expert in gate_up]),
            np.stack([unpack_records(expert, down_kind) for expert in down]))


def _records_matmul(x: np.ndarray, w: np.ndarray, kind: int) -> np.ndarray:
    return matmul_records_ref(x, pack_records(w, kind), kind)


def moe_gguf_ref(x: np.ndarray, router: np.ndarray, experts: GgufExperts, *, top_k: int,  # noqa: PLR0913 (the op's)
                 norm_topk_prob: bool, int8_activations: bool = True, layout: str = BLOCKS) -> np.ndarray:
    """The op's output for GGUF experts: each projection kiln.MatMulGGUF's arithmetic on that activation path and
    layout (records: `matmul_records_ref`); float32 [..., D]."""
    matmul = _records_matmul if layout == RECORDS else matmul_gguf_int8_ref if int8_activations else matmul_gguf_ref
    x = np.asarray(x, np.float32)
    e, d, f = experts.dims
    shapes = (np.broadcast_to(np.float32(0), (e, 2 * f, d)), np.broadcast_to(np.float32(0), (e, d, f)))  # no memory
    check_moe_shapes(x, router, *shapes, top_k)
    rows = x.reshape(-1, d)
    chosen, weights = route_ref(rows, router, top_k, norm_topk_prob)
    y = np.zeros(rows.shape, np.float64)
    for expert in np.unique(chosen):
        tokens, slots = np.nonzero(chosen == expert)
        gate = matmul(rows[tokens], *experts.projection(int(expert), "gate")).astype(np.float64)
        up = matmul(rows[tokens], *experts.projection(int(expert), "up")).astype(np.float64)
        act = (gate / (1.0 + np.exp(-np.clip(gate, -700, 700))) * up).astype(np.float32)
        out = matmul(act, *experts.projection(int(expert), "down")).astype(np.float64)
        y[tokens] += weights[tokens, slots, None] * out
    result: np.ndarray = y.astype(np.float32).reshape(x.shape)
    return result


def make_single_op_model(top_k: int, norm_topk_prob: bool, types: tuple[int, int, int], rank: int = 2,
                         int8_activations: bool | None = None, layout: str = BLOCKS) -> ModelProto:
    """A one-node ONNX model y = kiln.MoE(x, router, gate_up, down) with GGUF experts of these (gate, up, down) types
    (int8_activations None: the attribute absent) in `layout`, every input a graph input with symbolic dims; for
    tests and benchmarks."""
    from onnx import TensorProto, helper  # compile-time dependency only

    lead = [f"t{i}" for i in range(rank - 1)]
    names = ["x", "router", "gate_up", "down"]
    node = helper.make_node(OP_TYPE, names, ["y"], domain=OP_DOMAIN, top_k=top_k, norm_topk_prob=int(norm_topk_prob))
    node.attribute.extend(helper.make_attribute(name, int(t)) for name, t in zip(TYPE_ATTRIBUTES, types, strict=True))
    if int8_activations is not None:
        node.attribute.append(helper.make_attribute(INT8_ATTRIBUTE, int(int8_activations)))
    records = layout == RECORDS
    if records:
        node.attribute.append(helper.make_attribute(LAYOUT, RECORDS))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, "D"]),
              helper.make_tensor_value_info("router", TensorProto.FLOAT, ["E", "D"]),
              helper.make_tensor_value_info("gate_up", TensorProto.UINT8,
                                            ["E", "G2", "Sd", "Rg"] if records else ["E", "F2", "Bg"]),
              helper.make_tensor_value_info("down", TensorProto.UINT8,
                                            ["E", "Gd", "Sf", "Rd"] if records else ["E", "D", "Bd"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, "D"])]
    return single_node_model(node, "moe_gguf", inputs, outputs, OP_VERSION)
