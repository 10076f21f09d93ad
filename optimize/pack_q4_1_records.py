"""Pass (the build's last on the graph): kiln.MatMulQ4_1 weights and kiln.MoE's Q4_1 experts from blocks to the
kernels' records.

Every kiln.MatMulQ4_1 whose qs and dm are initializers in blocks gets them as records (kiln/matmul_q4_1.py, layout
"records": qs [ceil(N / 16), nb, 320], dm [N, 0]), and every kiln.MoE with constant Q4_1 experts gets each stack as
those records expert after expert (kiln/moe.py, layout "records": [E, rows / 16, K / 32, 320], dm [E, rows, 0]). The
engine writer puts them on page boundaries, ONNX Runtime maps them from the engine file, and the kernels read them
there: nothing is packed or copied at load, the weights' memory is the file's page cache (shared by every server of
the engine on a machine, kept across restarts). An engine whose kiln.MoE experts are records needs op-library ABI 11
(kiln.contract.engine_abi).

It runs after every pass that reads or writes Q4_1 blocks (quantization, the rescored head); the splits that follow
take records as they are (pipeline stages) or cut and repack them (tensor-parallel ranks: optimize/shard_weights.py).
`unpack_q4_1_records` is the inverse on a saved graph, for measuring and testing against blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from kiln import moe
from kiln.contract import OP_DOMAIN
from kiln.matmul_q4_1 import CENTRE_ATTRIBUTE, LAYOUT, OP_TYPE, RECORDS, Q4_1Weights, node_layout

from .quant.graph import initializer
from .shard_weights import WeightReader


def holds_q4_1_centres(model: ir.Model) -> bool:
    """Whether any kiln.MatMulQ4_1 or kiln.MoE of the graph carries a centre attribute (Q4_0 blocks: op-library ABI
    15, kiln.contract.engine_abi)."""
    return any(node.domain == OP_DOMAIN and node.op_type in (OP_TYPE, moe.OP_TYPE)
               and CENTRE_ATTRIBUTE in node.attributes for node in model.graph)


def pack_q4_1_records(model: ir.Model) -> int:
    """Rewrite every kiln.MatMulQ4_1 with constant blocks in place; returns how many nodes it rewrote."""
    packed: dict[tuple[str, str], tuple[ir.Value, ir.Value]] = {}  # a weight several nodes read is packed once
    count = 0
    for node in model.graph:
        if node.op_type != OP_TYPE or node.domain != OP_DOMAIN or _layout(node) == RECORDS:
            continue
        qs, dm = node.inputs[1], node.inputs[2]
        if qs is None or dm is None or qs.const_value is None or dm.const_value is None:
            continue  # weights computed in the graph stay blocks, which the kernel packs per call
        key = (qs.name or "", dm.name or "")
        if key not in packed:
            weights = Q4_1Weights.unpack(qs.const_value.numpy(), dm.const_value.numpy())
            records, channels = weights.pack_records()
            stem = key[0].removesuffix(".qs")
            packed[key] = (initializer(model, f"{stem}.records", records),
                           initializer(model, f"{stem}.channels", channels))
        node.replace_input_with(1, packed[key][0])
        node.replace_input_with(2, packed[key][1])
        node.attributes[LAYOUT] = ir.AttrString(LAYOUT, RECORDS)
        for blocks in (qs, dm):  # dropped as soon as nothing reads them: the weights are never held twice
            if blocks.is_initializer() and not blocks.uses():
                del model.graph.initializers[blocks.name or ""]
        count += 1
    return count


def pack_moe_q4_1_records(model: ir.Model) -> int:
    """Rewrite every kiln.MoE with constant Q4_1 experts in blocks in place; returns how many nodes it rewrote. One
    stack is converted at a time and its blocks dropped as it is replaced."""
    count = 0
    for node in model.graph:
        if node.op_type != moe.OP_TYPE or node.domain != OP_DOMAIN or _layout(node) == RECORDS \
                or len(node.inputs) != 6:
            continue  # float and GGUF experts (no dm inputs) and records stay as they are
        if any(v is None or v.const_value is None for v in node.inputs[2:]):
            continue  # experts computed in the graph stay blocks, which the kernel packs per call
        for position in (2, 3):  # gate_up and its dm (input 4), down and its dm (input 5)
            nibbles, dm = node.inputs[position], node.inputs[position + 2]
            assert nibbles is not None and dm is not None and nibbles.const_value is not None \
                and dm.const_value is not None
            records, rows = moe.q4_1_experts_to_records(nibbles.const_value.numpy(), dm.const_value.numpy())
            stem = (nibbles.name or "experts").removesuffix(".q4_1")
            node.replace_input_with(position, initializer(model, f"{stem}.records", records))
            node.replace_input_with(position + 2, initializer(model, f"{stem}.rows", rows))
            for blocks in (nibbles, dm):  # dropped as soon as nothing reads them: never two stacks' worth held twice
                if blocks.is_initializer() and not blocks.uses():
                    del model.graph.initializers[blocks.name or ""]
        node.attributes[LAYOUT] = ir.AttrString(LAYOUT, RECORDS)
        count += 1
    return count


def _layout(node: ir.Node) -> str | None:
    attribute = node.attributes.get(LAYOUT)
    return None if attribute is None else attribute.as_string()


def unpack_q4_1_records(graph: onnx.GraphProto, source_dir: Path, dense: bool = True) -> int:
    """Rewrite a saved graph's kiln.MatMulQ4_1 records (unless not `dense`) and kiln.MoE Q4_1 expert records
    (external data under source_dir) as in-graph blocks, the layouts engines held before records; returns how many
    nodes it rewrote."""
    reader = WeightReader(graph, source_dir)
    blocks = {}
    nodes = [n for n in graph.node if dense and n.op_type == OP_TYPE and n.domain == OP_DOMAIN
             and node_layout(n) == RECORDS]
    for node in nodes:
        weights = Q4_1Weights.unpack_records(reader.array(node.input[1]), reader.array(node.input[2]))
        blocks[node.input[1]], blocks[node.input[2]] = weights.pack()
    moe_nodes = [n for n in graph.node if n.op_type == moe.OP_TYPE and n.domain == OP_DOMAIN
                 and node_layout(n) == RECORDS and len(n.input) == 6]  # Q4_1 experts (GGUF ones have no dm inputs)
    for node in moe_nodes:
        for w in (2, 3):
            blocks[node.input[w]], blocks[node.input[w + 2]] = moe.q4_1_experts_from_records(
                reader.array(node.input[w]), reader.array(node.input[w + 2]))
    return set_blocks(graph, nodes + moe_nodes, blocks)


def set_blocks(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], blocks: dict[str, np.ndarray]) -> int:
    """The nodes' layout attribute dropped (blocks, the default) and each initializer named in `blocks` replaced by
    its array, in the saved graph; returns how many nodes."""
    for node in nodes:
        node.attribute.remove(next(a for a in node.attribute if a.name == LAYOUT))
    for tensor in graph.initializer:
        if tensor.name in blocks:
            tensor.CopyFrom(numpy_helper.from_array(blocks.pop(tensor.name), tensor.name))
    return len(nodes)
