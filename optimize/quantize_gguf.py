"""Pass: a GGUF file's quantized linears kept in their own blocks -> kiln.MatMulGGUF (no re-rounding).

Each linear whose weight came from a GGUF matrix of a type kiln.MatMulGGUF executes (kiln/gguf_blocks.py: Q4_0,
Q8_0, Q4_K, Q5_K, Q6_K) becomes one kiln.MatMulGGUF node over the file's bytes, which the engine stores as they are:
the engine computes with exactly the file's weights. The rows arrive as the file holds them but for llama.cpp's q/k
permutation, which the reader undoes on whole rows of blocks (exact). A fused projection (q/k/v, gate/up) whose parts
have one type is one node over the stacked rows; parts of different types (a Q4_K_M file's Q6_K v beside Q4_K q
and k) are one node per run of a type, their outputs concatenated. The LM head is a linear like the others (a tied
head reads the embedding table's blocks). A linear without executable blocks (float matrices, other ggml types)
falls back to int8 per output channel (MatMulNBits), and the pass reports how many did.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import numpy as np
import onnx_ir as ir

from kiln.contract import OP_DOMAIN
from kiln.export.progress import track
from kiln.export.tensor_files import FileBlocks
from kiln.gguf_blocks import FORMATS, GgmlType, row_bytes
from kiln.matmul_gguf import OP_TYPE, TYPE_ATTRIBUTE

from .quant.graph import Linear, ensure_opset, find_linears, initializer, prune, replace_linear
from .quant.nbits import MS_DOMAIN, make_matmul_nbits
from .quant.rtn import per_channel_as_groups

_EXECUTABLE = {int(kind) for kind in GgmlType}


@dataclass(frozen=True)
class GgufCounts:
    kept: int  # linears computed on the file's blocks
    fallback: int  # linears without executable blocks: int8 per channel

    @property
    def total(self) -> int:
        return self.kept + self.fallback


def executable_blocks(lin: Linear) -> tuple[FileBlocks, ...]:
    """The linear's file blocks when every part is of an executable type whose rows hold whole blocks of its K,
    else ()."""
    blocks = lin.file_blocks
    n, k = lin.shape
    if not blocks or sum(b.rows for b in blocks) != n:
        return ()
    for b in blocks:
        if b.ggml_type not in _EXECUTABLE or k % FORMATS[GgmlType(b.ggml_type)].weights:
            return ()
    return blocks


def quantize_gguf(model: ir.Model) -> GgufCounts:
    """Rewrite every linear MatMul in place."""
    linears = find_linears(model)
    kept = 0
    for lin in track(linears, "quantize gguf", "linear"):
        blocks = executable_blocks(lin)
        if blocks:
            nodes, output = _block_nodes(model, lin, blocks)
            ensure_opset(model, OP_DOMAIN)
            kept += 1
        else:
            node = make_matmul_nbits(model, lin.activation, per_channel_as_groups(lin.weight, 128),
                                     f"{lin.weight_name}.int8", lin.bias)
            ensure_opset(model, MS_DOMAIN)
            nodes, output = [node], node.outputs[0]
        replace_linear(model, lin, nodes, output)
    if linears:
        prune(model)
    return GgufCounts(kept, len(linears) - kept)


def _block_nodes(model: ir.Model, lin: Linear, blocks: tuple[FileBlocks, ...]) -> tuple[list[ir.Node], ir.Value]:
    """One kiln.MatMulGGUF per run of parts of one type (their rows stacked), concatenated when more than one."""
    k = lin.shape[1]
    bias = None
    if lin.bias is not None and lin.bias.const_value is not None:
        bias = lin.bias.const_value.numpy().astype(np.float32)
    nodes: list[ir.Node] = []
    start = 0
    for kind, run in groupby(blocks, key=lambda b: b.ggml_type):
        parts = list(run)
        rows = sum(b.rows for b in parts)
        data = np.concatenate([_read(b, k) for b in parts]) if len(parts) > 1 else _read(parts[0], k)
        suffix = f".{GgmlType(kind).name.lower()}" + (f".rows{start}" if len(blocks) > 1 else "")
        inputs = [lin.activation, initializer(model, f"{lin.weight_name}{suffix}", data)]
        if bias is not None:
            inputs.append(initializer(model, f"{lin.weight_name}{suffix}.bias", bias[start:start + rows]))
        nodes.append(ir.node(OP_TYPE, inputs, attributes={TYPE_ATTRIBUTE: int(kind)}, domain=OP_DOMAIN,
                             name=f"{lin.weight_name}{suffix}.MatMulGGUF"))
        start += rows
    if len(nodes) == 1:
        return nodes, nodes[0].outputs[0]
    concat = ir.node("Concat", [node.outputs[0] for node in nodes], attributes={"axis": -1},
                     name=f"{lin.weight_name}.gguf.Concat")
    return [*nodes, concat], concat.outputs[0]


def _read(blocks: FileBlocks, k: int) -> np.ndarray:
    data = blocks.read()
    expected = (blocks.rows, row_bytes(GgmlType(blocks.ggml_type), k))
    if data.shape != expected or data.dtype != np.uint8:
        raise ValueError(f"file blocks of {GgmlType(blocks.ggml_type).name} are {data.dtype} {list(data.shape)}, "
                         f"the weight implies uint8 {list(expected)}")
    return data
