"""Pass: a GGUF file's quantized linears kept in their own blocks -> kiln.MatMulGGUF (no re-rounding).

Each linear whose weight came from a GGUF matrix of a type kiln.MatMulGGUF executes (kiln/gguf_blocks.py: Q4_0,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) becomes one kiln.MatMulGGUF node over the file's bytes, which the engine stores
as they are: the engine computes with exactly the file's weights, and with int8 activations (int8_activations = 1,
the `gguf` scheme: integer block dots as llama.cpp's; Q5_0 / Q5_1, which have no int8 kernel, keep 0) or float32
ones (`gguf-exact`). The rows arrive as the file holds them but for llama.cpp's q/k permutation, which the reader
undoes on whole rows of blocks (exact). A fused projection (q/k/v, gate/up) whose parts have one type is one node
over the stacked rows; parts of different types (a Q4_K_M file's Q6_K v beside Q4_K q and k) are one node per run
of a type, their outputs concatenated. The LM head is a linear like the others (a tied head reads the embedding
table's blocks). Q4_1 blocks (SmolLM2's file) go to kiln.MatMulQ4_1, decoded from the bytes: the file's weights
exactly, with that kernel's int8 activations; so do Q4_0 blocks under int8 activations (w = d (q - 8) is a Q4_1
block whose minimum is -8 d, exact in float16), whose records tile is the fastest kiln has for 4-bit codes, centred
at 8 (the node's centre attribute), so the sums are llama.cpp's Q4_0 ones, d * xs * ((q - 8) . xq). A
linear without usable blocks (float matrices, Q2_K / Q3_K, the i-quants) falls back to int8 per output channel
(MatMulNBits), and the pass reports how many did.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import numpy as np
import onnx_ir as ir

from kiln.contract import OP_DOMAIN
from kiln.export.progress import track
from kiln.export.tensor_files import FileBlocks
from kiln.gguf_blocks import FORMATS, GgmlType, row_bytes
from kiln.gguf_int8 import INT8_KINDS
from kiln.matmul_gguf import INT8_ATTRIBUTE, OP_TYPE, TYPE_ATTRIBUTE
from kiln.matmul_q4_1 import BLOCK as Q4_1_BLOCK
from kiln.matmul_q4_1 import CENTRE, CENTRE_ATTRIBUTE, Q4_0_CENTRE, Q4_1Weights
from kiln.matmul_q4_1 import OP_TYPE as Q4_1_OP_TYPE

from .quant.graph import Linear, ensure_opset, find_linears, initializer, prune, replace_linear
from .quant.nbits import MS_DOMAIN, make_matmul_nbits
from .quant.rtn import per_channel_as_groups

_EXECUTABLE = {int(kind) for kind in GgmlType}
GGML_Q4_1 = 3  # gguf.GGMLQuantizationType.Q4_1: 32 weights, 20 bytes (d f16, m f16, 16 bytes of nibbles)
_Q4_1_BYTES = 20
_Q4_0_BYTES = FORMATS[GgmlType.Q4_0].nbytes  # 18: d f16, 16 bytes of nibbles


@dataclass(frozen=True)
class GgufCounts:
    kept: int  # linears computed on the file's blocks (kiln.MatMulGGUF)
    q4_1: int  # linears of Q4_1 blocks: kiln.MatMulQ4_1 on the decoded codes
    fallback: int  # linears without usable blocks: int8 per channel

    @property
    def total(self) -> int:
        return self.kept + self.q4_1 + self.fallback


def default_quantization(model: str) -> str:
    """What `kiln build MODEL` quantizes with when not told: "gguf" for a .gguf file whose matrices and expert stacks
    (the embedding table and the routers aside) are all of types kiln.MatMulGGUF executes (a Q4_K_M file runs as it
    is, as in llama.cpp), else "none". A mixture-of-experts router (ffn_gate_inp, which llama.cpp's quantizer leaves
    float32) is kiln.MoE's float input, not a linear."""
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        return "none"
    from gguf import GGUFReader  # compile-time dependency only

    types = [int(t.tensor_type) for t in GGUFReader(str(path)).tensors
             if len(t.shape) in (2, 3) and not t.name.startswith("token_embd") and ".ffn_gate_inp" not in t.name]
    return "gguf" if types and all(t in _EXECUTABLE for t in types) else "none"


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


def quantize_gguf(model: ir.Model, int8_activations: bool = True) -> GgufCounts:
    """Rewrite every linear MatMul in place; kiln.MatMulGGUF nodes with int8 or float32 activations."""
    linears = find_linears(model)
    kept = q4_1 = 0
    for lin in track(linears, "quantize gguf", "linear"):
        q4_1_found = _q4_1_codes(lin, with_q4_0=int8_activations)
        blocks = executable_blocks(lin) if q4_1_found is None else ()
        if blocks:
            nodes, output = _block_nodes(model, lin, blocks, int8_activations)
            ensure_opset(model, OP_DOMAIN)
            kept += 1
        elif q4_1_found is not None:
            node = _q4_1_node(model, lin, *q4_1_found)
            ensure_opset(model, OP_DOMAIN)
            nodes, output, q4_1 = [node], node.outputs[0], q4_1 + 1
        else:
            node = make_matmul_nbits(model, lin.activation, per_channel_as_groups(lin.weight, 128),
                                     f"{lin.weight_name}.int8", lin.bias)
            ensure_opset(model, MS_DOMAIN)
            nodes, output = [node], node.outputs[0]
        replace_linear(model, lin, nodes, output)
    if linears:
        prune(model)
    return GgufCounts(kept, q4_1, len(linears) - kept - q4_1)


def _block_nodes(model: ir.Model, lin: Linear, blocks: tuple[FileBlocks, ...],
                 int8_activations: bool) -> tuple[list[ir.Node], ir.Value]:
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
        attributes = {TYPE_ATTRIBUTE: int(kind), INT8_ATTRIBUTE: int(int8_activations and kind in INT8_KINDS)}
        nodes.append(ir.node(OP_TYPE, inputs, attributes=attributes, domain=OP_DOMAIN,
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


def _q4_1_codes(lin: Linear, with_q4_0: bool) -> tuple[Q4_1Weights, float] | None:
    """The linear's weights as Q4_1 codes when every part is Q4_1 (or, with_q4_0, every part Q4_0 and each minimum
    -8 d a float16), read here, with the kiln.MatMulQ4_1 centre of their type; else None."""
    blocks = lin.file_blocks
    n, k = lin.shape
    types = {b.ggml_type for b in blocks}
    if types == {GGML_Q4_1}:
        name, nbytes, decode, centre = "Q4_1", _Q4_1_BYTES, q4_1_weights, CENTRE
    elif with_q4_0 and types == {GgmlType.Q4_0}:
        name, nbytes, decode, centre = "Q4_0", _Q4_0_BYTES, q4_0_as_q4_1, Q4_0_CENTRE
    else:
        return None
    if k % Q4_1_BLOCK:
        return None
    data = np.concatenate([b.read() for b in blocks])
    if data.shape != (n, k // Q4_1_BLOCK * nbytes):
        raise ValueError(f"{name} file blocks are {list(data.shape)} bytes, the weight implies "
                         f"[{n}, {k // Q4_1_BLOCK * nbytes}]")
    codes = decode(data)
    return None if codes is None else (codes, centre)


def q4_1_weights(data: np.ndarray) -> Q4_1Weights:
    """Q4_1 rows uint8 [N, K / 32 * 20] as their codes (d, m float16; byte i: weight i low, weight 16 + i high)."""
    n = data.shape[0]
    b = data.reshape(n, -1, _Q4_1_BYTES)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
    qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)
    return Q4_1Weights(np.ascontiguousarray(q), np.ascontiguousarray(d), np.ascontiguousarray(m))


def q4_0_as_q4_1(data: np.ndarray) -> Q4_1Weights | None:
    """Q4_0 rows uint8 [N, K / 32 * 18] (w = d (q - 8)) as Q4_1 codes with minimum -8 d, the same weights exactly; None
    where -8 d is no float16 (|d| past 8188)."""
    n = data.shape[0]
    b = data.reshape(n, -1, _Q4_0_BYTES)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    with np.errstate(over="ignore"):
        m = (d.astype(np.float32) * np.float32(-8)).astype(np.float16)
    if not np.array_equal(m.astype(np.float32), d.astype(np.float32) * np.float32(-8)):
        return None
    qs = b[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)
    return Q4_1Weights(np.ascontiguousarray(q), np.ascontiguousarray(d), np.ascontiguousarray(m))


def _q4_1_node(model: ir.Model, lin: Linear, codes: Q4_1Weights, centre: float) -> ir.Node:
    """kiln.MatMulQ4_1 on Q4_1 codes, with a centre attribute where it is not the default."""
    packed, dm = codes.pack()
    inputs = [lin.activation, initializer(model, f"{lin.weight_name}.q4_1.qs", packed),
              initializer(model, f"{lin.weight_name}.q4_1.dm", dm)]
    attributes = {CENTRE_ATTRIBUTE: centre} if centre != CENTRE else None
    return ir.node(Q4_1_OP_TYPE, inputs + ([lin.bias] if lin.bias is not None else []), attributes=attributes,
                   domain=OP_DOMAIN, name=f"{lin.weight_name}.MatMulQ4_1")
