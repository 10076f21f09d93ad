"""Pass: an int4 LM head whose best candidates are rescored at 8 bits (`--lm-head int4-rescored`).

Single-stream decode reads every weight once per token, and with an int8 head the head is a third of those
bytes on SmolLM2 (docs/design.md, "Single-stream decode is a weight budget"). An int4 head halves them but its
logits are coarse (+4-8% perplexity). Decoding and sampling need the logits exactly only near the top, so for a
step of few logits rows the head stays int4 for the whole vocabulary and the logits of its RESCORE_TOP_K best
tokens are recomputed from an 8-bit table of the same weights, k rows of it per token instead of V:

    approx  = head_int4(h)                                 [..., V]
    logits  = kiln.RescoreLogits(approx, h, table, k=256)  [..., V]: approx's k largest as table[top] @ h

(kiln/rescore_logits.py; it replaced TopK -> GatherBlockQuantized -> MatMul -> ScatterElements, ~6% of a
single-stream step.)

With kiln.MatMulQ4_1 as the int4 head (int4-q4_1) every step is rescored, at any row count: its channels-in-lanes
kernel is cheaper per product than the int8 MatMulNBits at any batch and the rows are rescored in parallel, so a
batch of 32 decodes ~5-9% faster than with the int8 head (docs/design.md, "The LM head"), and a row's logits do not
depend on how many rows share its step. Behind a 4-bit MatMulNBits head (int4-rtn, int4-awq) a step of more than
RESCORED_HEAD_MAX_ROWS rows is bound by arithmetic, not bytes, and the int4 head costs more than it saves there: an
If on the row count sends it to the int8 per-channel head (`--lm-head int8`'s). For a tied
head the table is the embedding's (the 8-bit blocks of 32 that quantize_embedding made for the first Gather); an
untied head gets its own. Capture the head's rows with `head_rows` before the scheme's pass quantizes the head,
and call `rescore_lm_head` after quantize_embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.contract import LOGITS, OP_DOMAIN
from kiln.quant_scheme import RESCORED_HEAD_MAX_ROWS
from kiln.rescore_logits import OP_TYPE as RESCORE_OP

from ._common import soft_cap_input
from .quant.graph import Linear, ensure_opset, find_linears, initializer, is_lm_head
from .quant.nbits import make_matmul_nbits
from .quant.rtn import per_channel_as_groups, quantize_groupwise
from .quantize_embedding import BLOCK_SIZE, TABLE_KEY

# Measured on SmolLM2 int4-q4_1 (docs/design.md, "The LM head"): 64 candidates leave
# +0.4-1.3% perplexity over the int8 head (the tail's int4 logits), 256 +0.2-0.5%, 1024 none, but ORT's TopK and
# GatherBlockQuantized at k = 1024 cost a batch-1 step what the int4 head saved; 256 keeps the whole saving.
RESCORE_TOP_K = 256
_SHAPE_ONLY = ("Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten")


@dataclass(frozen=True)
class HeadRows:
    """The LM head's float linear (the embedding table behind it when tied); its weight [V, D] is read from the
    initializer when asked, which stays readable after the scheme's pass has replaced the head."""

    linear: Linear

    @property
    def weight(self) -> np.ndarray:
        return self.linear.weight

    @property
    def source(self) -> str:
        return self.linear.weight_name

    @property
    def shape(self) -> tuple[int, int]:
        return self.linear.shape


def head_rows(model: ir.Model) -> HeadRows:
    """The LM head's rows, read while the head is still a float MatMul."""
    heads = [lin for lin in find_linears(model) if is_lm_head(lin)]
    if len(heads) != 1:
        raise ValueError(f"an int4-rescored LM head needs exactly one float LM head in the graph, found {len(heads)}")
    return HeadRows(heads[0])


def _head_node(model: ir.Model) -> ir.Node:
    """The node computing the logits output, behind shape-only ops."""
    output = next((v for v in model.graph.outputs if v.name == LOGITS), None)
    if output is None:
        raise ValueError(f"the graph has no {LOGITS!r} output to rescore")
    node = (soft_cap_input(output) or output).producer()  # a final soft-cap keeps the order of the logits
    while node is not None and node.op_type in _SHAPE_ONLY:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or not _is_int4_matmul(node):
        found = "nothing" if node is None else node.op_type
        raise ValueError(f"the logits come from {found}, not from an int4 LM head (MatMulQ4_1 or 4-bit MatMulNBits); "
                         "Medusa heads, which share the head's rows, do not combine with an int4-rescored head")
    return node


def _is_int4_matmul(node: ir.Node) -> bool:
    if node.op_type == "MatMulQ4_1":
        return True
    bits = node.attributes.get("bits")
    return node.op_type == "MatMulNBits" and bits is not None and bits.as_int() == 4


def _table(model: ir.Model, rows: HeadRows) -> list[ir.Value]:
    """[data, scales, zero points] of GatherBlockQuantized over the head's 8-bit rows: the embedding's, when
    quantize_embedding made them from the same initializer (a tied head), else new ones."""
    for node in model.graph:
        if node.op_type == "GatherBlockQuantized" and node.metadata_props.get(TABLE_KEY) == rows.source:
            return list(node.inputs[0:1]) + list(node.inputs[2:4])
    table = quantize_groupwise(rows.weight, 8, BLOCK_SIZE)
    return [initializer(model, "lm_head.rows.q8", table.q), initializer(model, "lm_head.rows.scales", table.scales),
            initializer(model, "lm_head.rows.zero_points", table.zero_points)]


def rescore_lm_head(model: ir.Model, rows: HeadRows, top_k: int = RESCORE_TOP_K) -> int | None:
    """Rescore the (already int4) head's top_k logits from the 8-bit table: at every step for a MatMulQ4_1 head,
    else up to RESCORED_HEAD_MAX_ROWS rows with the int8 per-channel head above (an If). Returns that row limit,
    None for every step. Run after quantize_embedding (a tied table is then 8-bit)."""
    head = _head_node(model)
    few_rows = None if head.op_type == "MatMulQ4_1" else RESCORED_HEAD_MAX_ROWS
    hidden, approx = head.inputs[0], head.outputs[0]
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, not {top_k}")
    vocab, hidden_size = rows.shape
    if hidden_size % BLOCK_SIZE:
        raise ValueError(f"an int4-rescored head gathers 8-bit blocks of {BLOCK_SIZE}: the hidden size "
                         f"{hidden_size} is not a multiple")
    top_k = min(top_k, vocab)  # a vocabulary smaller than k: every logit rescored
    data, scales, zero_points = _table(model, rows)
    readers = [(use.node, use.idx) for use in approx.uses()]
    was_output = approx.is_graph_output()
    ensure_opset(model, OP_DOMAIN)
    rescore = _node(RESCORE_OP, [approx, hidden, data, scales, zero_points], "rescore", domain=OP_DOMAIN, k=top_k)
    if few_rows is None:
        logits = _like(rescore.outputs[0], approx)
        model.graph.insert_after(head, rescore)
    else:
        model.graph.remove(head)
        rescored = ir.Graph([], [_like(rescore.outputs[0], approx)], nodes=[head, rescore],
                            name="lm_head.int4_rescored")
        logits = _like(_by_rows(model, hidden, approx, few_rows, rescored, rows), approx)
    for reader, index in readers:
        reader.replace_input_with(index, logits)
    name = approx.name
    approx.name = f"{name}.int4"
    logits.name = name
    if was_output:  # the head wrote the logits output itself: the rescored logits take its place
        outputs = model.graph.outputs
        outputs[outputs.index(approx)] = logits
    model.graph.sort()
    return few_rows


def _node(op: str, inputs: list[ir.Value], name: str, domain: str = "", **attributes) -> ir.Node:
    made = ir.node(op, inputs, attributes, domain=domain, name=f"lm_head.{name}")
    made.outputs[0].name = f"lm_head.{name}"  # named: a subgraph's unnamed values clash with the graph's
    return made


def _like(value: ir.Value, approx: ir.Value) -> ir.Value:
    """value typed and shaped as the int4 head's logits, which every head here replaces."""
    value.type, value.shape = approx.type, approx.shape
    return value


def _by_rows(model: ir.Model, hidden: ir.Value, approx: ir.Value, few_rows: int, rescored: ir.Graph,
             rows: HeadRows) -> ir.Value:
    """An If on the step's logits rows: the rescored head up to few_rows, the int8 per-channel head above."""
    few = initializer(model, "lm_head.few_rows", np.array([few_rows], dtype=np.int64))
    wide = make_matmul_nbits(model, hidden, per_channel_as_groups(rows.weight, 128), "lm_head.int8")  # the default
    wide.outputs[0].name = "lm_head.int8"
    int8 = ir.Graph([], [_like(wide.outputs[0], approx)], nodes=[wide], name="lm_head.int8")
    count = _node("Shape", [hidden], "row_count", start=-2, end=-1)  # logits rows: [1, T, D] or [T, D]
    many = _node("Greater", [count.outputs[0], few], "many_rows")
    many_scalar = _node("Squeeze", [many.outputs[0]], "many_rows_scalar")
    switch = _node("If", [many_scalar.outputs[0]], "by_rows", then_branch=int8, else_branch=rescored)
    model.graph.extend([count, many, many_scalar, switch])
    return switch.outputs[0]
