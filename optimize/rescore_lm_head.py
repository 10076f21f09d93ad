"""Pass: an int4 LM head whose best candidates are rescored at 8 bits (`--lm-head int4-rescored`).

Single-stream decode reads every weight once per token, and with an int8 head the head is a third of those
bytes on SmolLM2 (docs/design.md, "Single-stream decode is a weight budget"). An int4 head halves them but its
logits are coarse (+4-8% perplexity). Decoding and sampling need the logits exactly only near the top, so the
head stays int4 for the whole vocabulary and the logits of its RESCORE_TOP_K best tokens are recomputed from an
8-bit table of the same weights, k rows of it per token instead of V:

    approx  = head_int4(h)                       [..., V]
    _, top  = TopK(approx, k = 256)              [..., k]
    exact   = Gather(table, top) @ h             [..., k]
    logits  = ScatterElements(approx, top, exact)

For a tied head the table is the embedding table the first Gather already reads (quantize_embedding then makes
both Gathers one 8-bit table of blocks of 32); an untied head gets its own table. Capture the head's rows with
`head_rows` before the scheme's pass quantizes the head, and call `rescore_lm_head` after it and before
quantize_embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from .quant.graph import find_linears, initializer, is_lm_head

# Measured on SmolLM2 int4-q4_1 (docs/design.md, "An int4 LM head rescored at 8 bits"): 64 candidates leave
# +0.4-1.3% perplexity over the int8 head (the tail's int4 logits), 256 +0.2-0.5%, 1024 none, but ORT's TopK and
# GatherBlockQuantized at k = 1024 cost a batch-1 step what the int4 head saved; 256 keeps the whole saving.
RESCORE_TOP_K = 256
LOGITS = "logits"
_SHAPE_ONLY = ("Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten")


@dataclass(frozen=True)
class HeadRows:
    """The LM head's float weight [V, D] and the initializer it came from (the embedding table when tied)."""

    weight: np.ndarray
    source: str


def head_rows(model: ir.Model) -> HeadRows:
    """The LM head's rows, read while the head is still a float MatMul."""
    heads = [lin for lin in find_linears(model) if is_lm_head(lin)]
    if len(heads) != 1:
        raise ValueError(f"an int4-rescored LM head needs exactly one float LM head in the graph, found {len(heads)}")
    return HeadRows(heads[0].weight, heads[0].weight_name)


def _head_node(model: ir.Model) -> ir.Node:
    """The node computing the logits output, behind shape-only ops."""
    output = next((v for v in model.graph.outputs if v.name == LOGITS), None)
    if output is None:
        raise ValueError(f"the graph has no {LOGITS!r} output to rescore")
    node = output.producer()
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


def _rows_table(model: ir.Model, rows: HeadRows) -> ir.Value:
    """The [V, D] float table to gather candidates from: the tied embedding table, or a new initializer."""
    tied = model.graph.initializers.get(rows.source)
    if tied is not None and tied.const_value is not None and tuple(tied.const_value.shape) == rows.weight.shape:
        return tied
    return initializer(model, "lm_head.rows", np.ascontiguousarray(rows.weight, dtype=np.float32))


def rescore_lm_head(model: ir.Model, rows: HeadRows, top_k: int = RESCORE_TOP_K) -> None:
    """Insert the rescoring after the (already quantized) head, in place."""
    head = _head_node(model)
    hidden, approx = head.inputs[0], head.outputs[0]
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, not {top_k}")
    top_k = min(top_k, rows.weight.shape[0])  # a vocabulary smaller than k: every logit rescored
    table = _rows_table(model, rows)
    last = initializer(model, "lm_head.rescore.last_axis", np.array([-1], dtype=np.int64))
    k = initializer(model, "lm_head.rescore.k", np.array([top_k], dtype=np.int64))
    readers = [(use.node, use.idx) for use in approx.uses()]

    def node(op: str, inputs: list[ir.Value], name: str, outputs: int = 1, **attributes) -> ir.Node:
        made = ir.node(op, inputs, attributes, num_outputs=outputs, name=f"lm_head.rescore.{name}")
        model.graph.append(made)
        return made

    top = node("TopK", [approx, k], "top_k", outputs=2, axis=-1, largest=1, sorted=0).outputs[1]
    candidates = node("Gather", [table, top], "rows", axis=0).outputs[0]  # [..., k, D]
    column = node("Unsqueeze", [hidden, last], "column").outputs[0]  # [..., D, 1]
    dots = node("MatMul", [candidates, column], "dots").outputs[0]  # [..., k, 1]
    exact = node("Squeeze", [dots, last], "exact").outputs[0]
    logits = node("ScatterElements", [approx, top, exact], "scatter", axis=-1).outputs[0]
    logits.type, logits.shape = approx.type, approx.shape
    for reader, index in readers:
        reader.replace_input_with(index, logits)
    if approx.is_graph_output():  # the head wrote the logits output itself: the scatter takes its place
        outputs = model.graph.outputs
        outputs[outputs.index(approx)] = logits
        name = approx.name
        approx.name = f"{name}.int4"
        logits.name = name
    else:
        logits.name = f"{approx.name}.rescored"
    model.graph.sort()
