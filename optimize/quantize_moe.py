"""Passes: kiln.MoE's float32 expert stacks -> Q4_1 experts (kiln/moe.py) or Q8_0 GGUF experts (kiln/moe_gguf.py),
llama.cpp's numbers per block of 32.

The experts are most of a mixture-of-experts model's bytes (OLMoE-1B-7B: 6.4 of its 6.9 B parameters), and a decode
step reads every chosen expert's rows once, so their width sets its speed. Each layer's gate_up [E, 2F, D] and down
[E, D, F] are quantized with optimize/quant/rtn.py's quantize_q4_1 (the rounding llama.cpp's quantizer uses: on a
Q4_1 GGUF this reproduces the file's numbers exactly) and packed as the op's uint8 nibbles + float16 (d, m) inputs.
One layer's stacks are read at a time (the build's initializers are lazy). A stack whose width is not a multiple of
32 stays float32, and the pass says how many it converted.

Under int8-weight-only the stacks become Q8_0 (`quantize_moe_experts_q8_0`: ggml's reference rounding, a float16
step per 32 weights) and the node kiln.MoE's GGUF experts of that type with int8 activations, the arithmetic of
kiln.MatMulGGUF's Q8_0 kernel, as the dense linears' int8 weights quantize their activations on the fly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from kiln.contract import OP_DOMAIN
from kiln.export.progress import track
from kiln.gguf_blocks import GgmlType
from kiln.matmul_gguf import INT8_ATTRIBUTE
from kiln.moe import OP_TYPE, Q4_BLOCK, pack_q4_1_experts
from kiln.moe_gguf import TYPE_ATTRIBUTES

from .quant.graph import initializer, lazy_initializer, prune
from .quant.rtn import Q8_0_BLOCK_BYTES, quantize_q4_1, quantize_q8_0


def moe_nodes(model: ir.Model) -> list[ir.Node]:
    return [node for node in model.graph if node.domain == OP_DOMAIN and node.op_type == OP_TYPE]


def quantize_moe_experts(model: ir.Model) -> int:
    """Rewrite every float kiln.MoE's experts to Q4_1 in place; returns how many nodes were converted."""
    nodes = [node for node in moe_nodes(model) if _convertible(node)]
    for node in track(nodes, "quantize experts", "layer"):
        packed = []
        for value in node.inputs[2:4]:
            assert value is not None and value.const_value is not None  # _convertible
            nibbles, dm = _q4_1(value.const_value.numpy())
            name = value.name or "experts"
            packed.append((initializer(model, f"{name}.q4_1", nibbles), initializer(model, f"{name}.q4_1.dm", dm)))
        use_q4_1_experts(node, *packed)
    if nodes:
        prune(model)
    return len(nodes)


def use_q4_1_experts(node: ir.Node, gate_up: tuple[ir.Value, ir.Value], down: tuple[ir.Value, ir.Value]) -> None:
    """node's expert inputs replaced by Q4_1 experts (kiln/moe.py): each stack's (nibbles, dm) initializers."""
    (gu, gu_dm), (dn, dn_dm) = gate_up, down
    node.replace_input_with(2, gu)
    node.replace_input_with(3, dn)
    node.resize_inputs(6)
    node.replace_input_with(4, gu_dm)
    node.replace_input_with(5, dn_dm)


def quantize_moe_experts_q8_0(model: ir.Model) -> int:
    """Rewrite every float kiln.MoE's experts to Q8_0 GGUF experts with int8 activations in place; returns how many
    nodes were converted. Each stack's blocks are computed when the engine writer reads them (one stack at a time)."""
    nodes = [node for node in moe_nodes(model) if _convertible(node)]
    for node in nodes:
        stacks = []
        for value in node.inputs[2:4]:
            assert value is not None and value.const_value is not None  # _convertible
            e, rows, k = (int(dim) for dim in value.const_value.shape)
            shape = (e, rows, k // Q4_BLOCK * Q8_0_BLOCK_BYTES)
            stacks.append(lazy_initializer(model, f"{value.name or 'experts'}.q8_0", shape, _q8_0_of(value)))
        # Q8_0 rows of the joined gate/up stack are gate's rows, then up's: GGUF experts' gate_up as the file has them
        use_gguf_experts(node, *stacks, (GgmlType.Q8_0,) * 3, int8=True)
    if nodes:
        prune(model)
    return len(nodes)


def use_gguf_experts(node: ir.Node, gate_up: ir.Value, down: ir.Value, types: tuple[int, int, int],
                     int8: bool) -> None:
    """node's expert inputs replaced by GGUF experts (kiln/moe_gguf.py), their types and activation path its
    attributes."""
    node.replace_input_with(2, gate_up)
    node.replace_input_with(3, down)
    for attribute, kind in zip(TYPE_ATTRIBUTES, types, strict=True):
        node.attributes[attribute] = ir.AttrInt64(attribute, int(kind))
    node.attributes[INT8_ATTRIBUTE] = ir.AttrInt64(INT8_ATTRIBUTE, int(int8))


def _convertible(node: ir.Node) -> bool:
    """Both expert stacks constant float32 and whole Q4_1 blocks wide (the dtype and shape only: nothing read)."""
    if len(node.inputs) != 4:
        return False
    for value in node.inputs[2:4]:
        tensor = value.const_value if value is not None else None
        if tensor is None or tensor.dtype != ir.DataType.FLOAT or tensor.shape[-1] % Q4_BLOCK:
            return False
    return True


def _q4_1(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    e, rows, k = stack.shape
    q = quantize_q4_1(np.ascontiguousarray(stack.reshape(e * rows, k), dtype=np.float32))
    return pack_q4_1_experts(q.q.reshape(e, rows, k), q.d.reshape(e, rows, -1), q.m.reshape(e, rows, -1))


def _q8_0_of(value: ir.Value) -> Callable[[], np.ndarray]:
    """The float stack's Q8_0 blocks uint8 [E, rows, k / 32 * 34], one expert quantized at a time (a layer's float
    stack is up to GBs; the temporaries stay one expert's)."""
    source = value.const_value
    assert source is not None

    def blocks() -> np.ndarray:
        stack = source.numpy()
        return np.stack([quantize_q8_0(expert) for expert in stack])

    return blocks
