"""Pass (at the engine writer, beside pack_q4_1_records): kiln.MatMulGGUF's Q4_K and Q6_K weights from the file's
blocks to the kernel's records.

Every kiln.MatMulGGUF of Q4_K or Q6_K blocks with int8 activations, constant weights and N a multiple of 16 gets them
as records (kiln/gguf_records.py: w [N / 16, K / 256, record bytes], attribute layout "records"): the file's numbers
in kiln.MatMulQ4_1's record layout, which ONNX Runtime maps from the engine file and the kernel reads in place.
The records are computed tensor by tensor as the engine writer asks for them (a lazy tensor over the file's
blocks), so the build never holds a model's records at once. An engine with them needs op-library ABI 12
(kiln.contract.engine_abi). `unpack_gguf_records` is the inverse on a saved graph, for measuring against blocks.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import numpy_helper

from kiln.contract import OP_DOMAIN
from kiln.gguf_blocks import ggml_type, row_weights
from kiln.gguf_records import BLOCKS, LAYOUT, RECORDS, can_pack, pack_records, records_shape, unpack_records
from kiln.matmul_gguf import INT8_ATTRIBUTE, OP_TYPE, TYPE_ATTRIBUTE

from .quant.graph import unique_name
from .shard_weights import WeightReader


def pack_gguf_records(model: ir.Model) -> int:
    """Rewrite every packable kiln.MatMulGGUF in place; returns how many nodes it rewrote."""
    packed: dict[str, ir.Value] = {}  # a weight several nodes read is packed once
    count = 0
    for node in model.graph:
        if node.op_type != OP_TYPE or node.domain != OP_DOMAIN or _layout(node) != BLOCKS:
            continue
        w = node.inputs[1]
        if w is None or w.const_value is None or len(w.const_value.shape) != 2:
            continue
        kind, int8 = _int_attribute(node, TYPE_ATTRIBUTE), bool(_int_attribute(node, INT8_ATTRIBUTE))
        n, row = (int(d) for d in w.const_value.shape)
        if not can_pack(kind, int8, n):
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


def _lazy_records(model: ir.Model, blocks: ir.Value, kind: int, n: int, row: int) -> ir.Value:
    source = blocks.const_value
    assert source is not None
    shape = records_shape(kind, n, row_weights(ggml_type(kind), row))
    value = ir.Value(name=f"{blocks.name}.records", shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.UINT8))
    unique_name(model, value)
    value.const_value = ir.LazyTensor(lambda: ir.tensor(pack_records(source.numpy(), kind)), ir.DataType.UINT8,
                                      ir.Shape(shape), name=value.name)
    model.graph.register_initializer(value)
    return value


def _int_attribute(node: ir.Node, name: str) -> int:
    attribute = node.attributes.get(name)
    return 0 if attribute is None else attribute.as_int()


def _layout(node: ir.Node) -> str:
    attribute = node.attributes.get(LAYOUT)
    return BLOCKS if attribute is None else attribute.as_string()


def node_layout(node: onnx.NodeProto) -> str:
    """A saved graph's kiln.MatMulGGUF node's weight layout (blocks where the attribute is absent)."""
    found = next((a for a in node.attribute if a.name == LAYOUT), None)
    return BLOCKS if found is None else found.s.decode()


def unpack_gguf_records(graph: onnx.GraphProto, source_dir: Path) -> int:
    """Rewrite a saved graph's kiln.MatMulGGUF records (external data under source_dir) as the file's blocks, the
    layout engines held before records; returns how many nodes it rewrote."""
    reader = WeightReader(graph, source_dir)
    nodes = [n for n in graph.node if n.op_type == OP_TYPE and n.domain == OP_DOMAIN and node_layout(n) == RECORDS]
    blocks = {node.input[1]: unpack_records(reader.array(node.input[1]), next(a.i for a in node.attribute
                                                                               if a.name == TYPE_ATTRIBUTE))
              for node in nodes}
    for node in nodes:
        node.attribute.remove(next(a for a in node.attribute if a.name == LAYOUT))
    for tensor in graph.initializer:
        if tensor.name in blocks:
            tensor.CopyFrom(numpy_helper.from_array(blocks.pop(tensor.name), tensor.name))
    return len(nodes)
