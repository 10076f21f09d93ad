"""Pass (at the engine writer, beside pack_q4_1_records): kiln.MatMulGGUF's Q4_K, Q5_K, Q6_K and Q8_0 weights from the
file's blocks to the kernel's records.

Every kiln.MatMulGGUF of Q4_K, Q5_K, Q6_K or Q8_0 blocks with int8 activations, constant weights, N a multiple of 16
and K of 256 gets them as records (kiln/gguf_records.py: w [N / 16, K / 256, record bytes], attribute layout "records"):
the file's numbers in kiln.MatMulQ4_1's record layout, which ONNX Runtime maps from the engine file and the kernel
reads in place. So
does every kiln.MoE whose GGUF experts are such types (gate and up of one type; kiln/moe_gguf.py's layout
"records": each expert's records, expert after expert).
The records are computed tensor by tensor as the engine writer asks for them (a lazy tensor over the file's
blocks), so the build never holds a model's records at once. An engine with them needs op-library ABI 12, 14 with
Q5_K or Q8_0 records (kiln.contract.engine_abi, `holds_newer_records`). `unpack_gguf_records` is the inverse on a saved
graph, for measuring against blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from kiln import moe, moe_gguf
from kiln.contract import OP_DOMAIN
from kiln.gguf_blocks import ggml_type, row_weights
from kiln.gguf_records import (
    ABI_14_KINDS,
    BLOCKS,
    LAYOUT,
    RECORDS,
    can_pack,
    pack_records,
    records_shape,
    unpack_records,
)
from kiln.matmul_gguf import INT8_ATTRIBUTE, OP_TYPE, TYPE_ATTRIBUTE
from kiln.matmul_q4_1 import node_layout
from kiln.moe_gguf import TYPE_ATTRIBUTES

from .pack_q4_1_records import set_blocks
from .quant.graph import lazy_initializer
from .shard_weights import WeightReader


def pack_gguf_records(model: ir.Model) -> int:
    """Rewrite every packable kiln.MatMulGGUF and kiln.MoE in place; returns how many nodes it rewrote."""
    packed: dict[str, ir.Value] = {}  # a weight several nodes read is packed once
    count = 0
    for node in model.graph:
        if node.domain != OP_DOMAIN or _layout(node) != BLOCKS:
            continue
        if node.op_type == moe.OP_TYPE:
            count += _pack_moe(model, node)
            continue
        if node.op_type != OP_TYPE:
            continue
        w = node.inputs[1]
        if w is None or w.const_value is None or len(w.const_value.shape) != 2:
            continue
        kind, int8 = _int_attribute(node, TYPE_ATTRIBUTE), bool(_int_attribute(node, INT8_ATTRIBUTE))
        n, row = (int(d) for d in w.const_value.shape)
        if not can_pack(kind, int8, n, row_weights(ggml_type(kind), row)):
            continue
        key = w.name or ""
        if key not in packed:
            packed[key] = _lazy_records(model, w, kind, n, row)
        node.replace_input_with(1, packed[key])
        node.attributes[LAYOUT] = ir.AttrString(LAYOUT, RECORDS)
        if w.is_initializer() and not w.uses():
            del model.graph.initializers[key]
        count += 1
    return count


def holds_newer_records(model: ir.Model) -> bool:
    """Whether any kiln.MatMulGGUF or kiln.MoE of the graph holds records of a type ABI 12 lacks (Q5_K, Q8_0: op-library
    ABI 14)."""
    for node in model.graph:
        if node.domain != OP_DOMAIN or _layout(node) != RECORDS:
            continue
        names = (TYPE_ATTRIBUTE,) if node.op_type == OP_TYPE else TYPE_ATTRIBUTES if node.op_type == moe.OP_TYPE else ()
        if any(_int_attribute(node, name) in ABI_14_KINDS for name in names if name in node.attributes):
            return True
    return False


def _pack_moe(model: ir.Model, node: ir.Node) -> int:
    """A kiln.MoE's GGUF experts as records when their types and dims allow (1), else as they are (0)."""
    if any(name not in node.attributes for name in TYPE_ATTRIBUTES) or len(node.inputs) != 4:
        return 0  # float or Q4_1 experts
    gate_up, down = node.inputs[2], node.inputs[3]
    if gate_up is None or down is None or gate_up.const_value is None or down.const_value is None:
        return 0
    types = tuple(_int_attribute(node, name) for name in TYPE_ATTRIBUTES)
    int8 = INT8_ATTRIBUTE not in node.attributes or bool(_int_attribute(node, INT8_ATTRIBUTE))  # absent: 1
    e, f2, _ = (int(v) for v in gate_up.const_value.shape)
    d = int(down.const_value.shape[1])
    if not moe_gguf.records_packable(types, int8, d, f2 // 2):
        return 0
    gate_kind, _, down_kind = types
    for position, stack, kind, rows, k in ((2, gate_up, gate_kind, f2, d), (3, down, down_kind, d, f2 // 2)):
        shape = (e, *records_shape(kind, rows, k))
        node.replace_input_with(position, _lazy(model, stack, shape, _stack_packer(stack, kind)))
        if stack.is_initializer() and not stack.uses():
            del model.graph.initializers[stack.name or ""]
    node.attributes[LAYOUT] = ir.AttrString(LAYOUT, RECORDS)
    return 1


def _stack_packer(stack: ir.Value, kind: int) -> Callable[[], np.ndarray]:
    source = stack.const_value
    assert source is not None
    return lambda: np.stack([pack_records(expert, kind) for expert in source.numpy()])


def _lazy_records(model: ir.Model, blocks: ir.Value, kind: int, n: int, row: int) -> ir.Value:
    source = blocks.const_value
    assert source is not None
    shape = records_shape(kind, n, row_weights(ggml_type(kind), row))
    return _lazy(model, blocks, shape, lambda: pack_records(source.numpy(), kind))


def _lazy(model: ir.Model, blocks: ir.Value, shape: tuple[int, ...], pack: Callable[[], np.ndarray]) -> ir.Value:
    """A new initializer `blocks`.records of this shape whose numbers `pack` computes when they are read."""
    return lazy_initializer(model, f"{blocks.name}.records", shape, pack)


def _int_attribute(node: ir.Node, name: str) -> int:
    attribute = node.attributes.get(name)
    return 0 if attribute is None else attribute.as_int()


def _layout(node: ir.Node) -> str:
    attribute = node.attributes.get(LAYOUT)
    return BLOCKS if attribute is None else attribute.as_string()


def unpack_gguf_records(graph: onnx.GraphProto, source_dir: Path) -> int:
    """Rewrite a saved graph's kiln.MatMulGGUF records (external data under source_dir) as the file's blocks, the
    layout engines held before records; returns how many nodes it rewrote."""
    reader = WeightReader(graph, source_dir)
    nodes = [n for n in graph.node if n.op_type == OP_TYPE and n.domain == OP_DOMAIN and node_layout(n) == RECORDS]
    blocks = {node.input[1]: unpack_records(reader.array(node.input[1]), next(a.i for a in node.attribute
                                                                               if a.name == TYPE_ATTRIBUTE))
              for node in nodes}
    moe_nodes = [n for n in graph.node if n.op_type == moe.OP_TYPE and n.domain == OP_DOMAIN
                 and node_layout(n) == RECORDS and any(a.name == TYPE_ATTRIBUTES[0] for a in n.attribute)]
    for node in moe_nodes:
        types = tuple(next(a.i for a in node.attribute if a.name == name) for name in TYPE_ATTRIBUTES)
        gate_up, down = moe_gguf.experts_from_records(reader.array(node.input[2]), reader.array(node.input[3]), types)
        blocks[node.input[2]], blocks[node.input[3]] = gate_up, down
    return set_blocks(graph, nodes + moe_nodes, blocks)
