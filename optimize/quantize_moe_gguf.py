"""Pass: a GGUF file's expert blocks kept as they are -> kiln.MoE's GGUF experts (kiln/moe_gguf.py), no re-rounding.

Under the `gguf` and `gguf-exact` schemes a mixture-of-experts file's ffn_gate_exps / ffn_up_exps / ffn_down_exps
become the op's gate_up and down inputs byte for byte, their types its gate_type / up_type / down_type attributes (a
Q4_K_M file's Q6_K down beside Q4_K in other layers, each layer's own), and the kernel computes with kiln.MatMulGGUF's
arithmetic: the engine serves the file's own weights. Activations as the dense nodes take them: int8 under `gguf`
(float32 for a layer with Q5_0 / Q5_1 experts, which have no int8 kernel), float32 under `gguf-exact`. The stacks'
bytes are read one layer at a time from the file (export/lazy_initializers.py's BlockRows carries where they are);
nothing is dequantized. A layer whose experts have no blocks or a type kiln.MatMulGGUF lacks (Q2_K, Q3_K, the
i-quants ...) keeps its float32 experts (the file's weights dequantized, exact), and the pass says how many. Q4_0
experts under int8 activations become kiln.MoE's Q4_1 experts (the same weights: `q4_0_as_q4_1`), as the dense Q4_0
linears become kiln.MatMulQ4_1's, for its records, centred at 8 as those are (the node's centre attribute).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.export.lazy_initializers import BlockRows
from kiln.export.progress import track
from kiln.export.tensor_files import FileBlocks
from kiln.gguf_blocks import FORMATS, GgmlType
from kiln.gguf_int8 import INT8_KINDS
from kiln.matmul_q4_1 import CENTRE_ATTRIBUTE, Q4_0_CENTRE
from kiln.moe import pack_q4_1_experts
from kiln.moe_gguf import gguf_experts

from .quant.graph import initializer, prune
from .quantize_gguf import q4_0_as_q4_1
from .quantize_moe import moe_nodes, use_gguf_experts, use_q4_1_experts

_EXECUTABLE = frozenset(int(kind) for kind in GgmlType)


@dataclass(frozen=True)
class MoeGgufCounts:
    kept: int  # layers whose experts are the file's blocks
    float32: int  # layers left with float32 experts (no blocks, or a type without a kernel)
    q4_1: int = 0  # layers of Q4_0 experts run as Q4_1 experts (the file's weights)


def keep_moe_gguf_experts(model: ir.Model, int8_activations: bool = True) -> MoeGgufCounts:
    """Rewrite every float kiln.MoE whose expert stacks have usable file blocks in place (int8 activations where
    asked for and every type has an int8 kernel); returns the counts."""
    nodes = [node for node in moe_nodes(model) if len(node.inputs) == 4]
    kept = [(node, parts) for node in nodes if (parts := _stack_blocks(node)) is not None]
    as_q4_1 = 0
    for node, (gate, up, down) in track(kept, "keep expert blocks", "layer"):
        gate_up_value = node.inputs[2]
        assert gate_up_value is not None and gate_up_value.const_value is not None  # _stack_blocks
        e, f2, d = gate_up_value.const_value.shape.numpy()
        stacks = [part.read().reshape(e, rows, -1) for part, rows in ((gate, f2 // 2), (up, f2 // 2), (down, d))]
        types = (gate.ggml_type, up.ggml_type, down.ggml_type)
        if int8_activations and set(types) == {GgmlType.Q4_0} and _use_q4_1(model, node, stacks):
            as_q4_1 += 1
            continue
        int8 = int8_activations and all(kind in INT8_KINDS for kind in types)
        experts = gguf_experts(*stacks, types, int8)
        suffix = ".".join(GgmlType(kind).name.lower() for kind in experts.types)
        gate_up = initializer(model, f"{gate_up_value.name or 'experts'}.{suffix}", experts.gate_up)
        down_name = node.inputs[3].name if node.inputs[3] is not None else None
        down = initializer(model, f"{down_name or 'experts'}.{suffix}", experts.down)
        use_gguf_experts(node, gate_up, down, experts.types, int8)
    if kept:
        prune(model)
    return MoeGgufCounts(len(kept) - as_q4_1, len(nodes) - len(kept), as_q4_1)


def _use_q4_1(model: ir.Model, node: ir.Node, stacks: list[np.ndarray]) -> bool:
    """node's Q4_0 stacks (gate, up, down: uint8 [E, rows, row bytes]) as Q4_1 experts; False (nothing changed) where a
    step's -8 d is no float16."""
    gate, up, down = stacks
    # each expert's gate rows, then its up rows: gate_up's order (both rows of D weights, the same bytes)
    pairs = [(2, np.concatenate([gate, up], axis=1)), (3, down)]
    codes = [q4_0_as_q4_1(stack.reshape(-1, stack.shape[-1])) for _, stack in pairs]
    if any(c is None for c in codes):
        return False
    packed = []
    for (position, stack), c in zip(pairs, codes, strict=True):
        assert c is not None
        e, rows = stack.shape[:2]
        nibbles, steps = pack_q4_1_experts(*(a.reshape(e, rows, -1) for a in (c.q, c.d, c.m)))
        base = getattr(node.inputs[position], "name", None) or "experts"
        packed.append((initializer(model, f"{base}.q4_0.q4_1", nibbles),
                       initializer(model, f"{base}.q4_0.q4_1.dm", steps)))
    use_q4_1_experts(node, *packed)
    node.attributes[CENTRE_ATTRIBUTE] = ir.AttrFloat32(CENTRE_ATTRIBUTE, Q4_0_CENTRE)  # Q4_0's own sums
    return True


def _stack_blocks(node: ir.Node) -> tuple[FileBlocks, FileBlocks, FileBlocks] | None:
    """(gate, up, down) file blocks of a node whose stacks have them, each of a type kiln.MatMulGGUF executes and rows
    of whole blocks; None otherwise (shapes and types only: nothing read)."""
    gate_up, down = (value.const_value if value is not None else None for value in node.inputs[2:4])
    if not isinstance(gate_up, BlockRows) or not isinstance(down, BlockRows):
        return None
    if len(gate_up.blocks) != 2 or len(down.blocks) != 1:
        return None
    e, f2, d = gate_up.shape.numpy()
    (gate, up), (dn,) = gate_up.blocks, down.blocks
    for part, rows, k in ((gate, f2 // 2, d), (up, f2 // 2, d), (dn, d, f2 // 2)):
        if part.ggml_type not in _EXECUTABLE or part.rows != e * rows or k % FORMATS[GgmlType(part.ggml_type)].weights:
            return None
    return gate, up, dn

