"""kiln.MatMulQ4_1 (domain "kiln", version 1): the contract and its executable spec.

The ONNX Runtime CPU kernel (runtime/ops/matmul_q4_1.cc) is tested against `matmul_q4_1_ref`.

Inputs (the weights in one of two layouts, named by the string attribute ``layout``)
  x        float32 [..., K]              K a multiple of 32; nb = K / 32 blocks per row
  layout "blocks" (the default; every graph before the build's last step, and engines of op-library ABI < 9):
  qs       uint8   [N, ceil(nb / 2), 32]  the 4-bit q of each output channel, two blocks per 32 bytes
  dm       float16 [N, 2, nb]             per block: row 0 the step d, row 1 the minimum m
  layout "records" (what an engine stores, ABI 9: the kernel's own layout, read where ONNX Runtime maps it):
  qs       uint8   [ceil(N / 16), nb, 320] records of 16 output channels per block of 32 inputs
  dm       float16 [N, 0]                 no numbers (d and m are in the records): its shape names N
  bias     float32 [N]                    optional
Attribute
  centre   float in [0, 15]               optional (absent: 7.5, the nibbles' mean; engines of op-library ABI < 15
                                          have none): c below; 8 for the blocks of a Q4_0 file
Output
  y        float32 [..., N]

Weights (llama.cpp's Q4_1 numbers): block b of a row holds 32 consecutive input channels, ``w = m + q * d``,
q in [0, 15], d and m float16 as in a Q4_1 GGUF.

Blocks: byte i of the 32 bytes of pair j holds element i of block 2j in its low nibble and element i of block 2j + 1
in its high one (an odd nb leaves the last pair's high nibbles 0): a channel's blocks in order, the layout the
quantizers write and the tensor-parallel split slices. The CPU kernel repacks constant blocks into records once, at
session load, into memory of its own.

Records: record (g, b) is 320 bytes for channels 16g .. 16g + 15 ("lanes" l = 0..15) and block b. Chunk j = 0..3
(bytes 64j .. 64j + 63) holds in lane l's 4 bytes 64j + 4l + i (i = 0..3) channel 16g + l's input 32b + 8j + i in the
low nibble and input 32b + 8j + 4 + i in the high one; bytes 256..287 are the 16 lanes' d and 288..319 their m
(float16, little-endian). Channels past N are zero bytes. A chunk is one 64-byte load of 16 channels x 4 inputs, the
operand of vpdpbusd against 4 int8 of a row, and a group's records are consecutive: a tile streams them. 320 bytes
are five cache lines, so every record starts on one when the tensor does (the engine writer puts external tensors
on page boundaries). `Q4_1Weights.pack_records` / `unpack_records` write and read the layout bit for bit as the
kernel's own packing does.

Semantics (llama.cpp's vec_dot_q4_1_q8_1, with exact block sums and centred nibbles): each row of x
is quantized per block of 32 to int8, ``xs = max|x_block| / 127`` (0 for an all-zero block),
``xq = round_half_even(x * (1 / xs))``, and with ``S = sum(x_block)``, ``E = S - xs * sum(xq)``:

    y[t, n] = sum_b  d * xs * (q . xq)  +  m * S  +  c * d * E   (+ bias[n])

which is ``sum_b m * S + d * (xs * ((q - c) . xq) + c * S)``: the minimum's term and the
codes' centre use the float block sum exactly, so int8 rounding only reaches the centred nibbles
q - c (llama.cpp's q8_1 multiplies the raw q in [0, 15] and stores xs * sum(xq) in float16: four
times the rounding noise, +1% perplexity on SmolLM2 here). c is the nibbles' mean, 7.5, unless the
node says otherwise: a Q4_0 block (w = d (q - 8)) runs as the Q4_1 block whose m is -8 d, and with
c = 8 the sum is ``d * xs * ((q - 8) . xq)``, llama.cpp's vec_dot_q4_0_q8_0 (the Q4_0 file's own
arithmetic, where 7.5 would leave 0.5 * d * E of rounding in every block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.contract import OP_DOMAIN
from kiln.op_models import single_node_model

if TYPE_CHECKING:
    from onnx import ModelProto, NodeProto

OP_TYPE = "MatMulQ4_1"
LAYOUT = "layout"  # the attribute naming the weights' layout
BLOCKS = "blocks"  # qs [N, ceil(nb / 2), 32], dm [N, 2, nb]; the default
RECORDS = "records"  # qs [ceil(N / 16), nb, 320], dm [N, 0]
LAYOUTS = (BLOCKS, RECORDS)
BLOCK = 32  # input channels per block
PAIR_BYTES = 32  # two blocks' nibbles
GROUP = 16  # output channels of a record
CHUNKS = 4  # a record's 64-byte chunks of nibbles: inputs 8j..8j+3 (low) and 8j+4..8j+7 (high) of chunk j
NIBBLE_BYTES = CHUNKS * GROUP * 4
RECORD_BYTES = NIBBLE_BYTES + 2 * GROUP * 2  # the nibbles, then 16 d and 16 m in float16
INT8_MAX = 127
CENTRE = 7.5  # the nibbles' mean, whose product with x is taken from the exact block sum
CENTRE_ATTRIBUTE = "centre"  # the node's c, where it is not CENTRE
Q4_0_CENTRE = 8.0  # Q4_0 blocks' own: w = d (q - 8)


@dataclass(frozen=True)
class Q4_1Weights:
    """A [N, K] weight in Q4_1: ``w = m + q * d`` per block of 32 along K."""

    q: np.ndarray  # uint8 [N, K], values in [0, 15]
    d: np.ndarray  # float16 [N, K / 32]
    m: np.ndarray  # float16 [N, K / 32]

    def __post_init__(self) -> None:
        if self.q.ndim != 2 or self.q.dtype != np.uint8 or self.q.shape[1] % BLOCK or self.q.max(initial=0) > 15:
            raise ValueError(f"q must be uint8 [N, K] with K a multiple of {BLOCK} and values < 16, "
                             f"got {self.q.dtype} {self.q.shape}")
        blocks = (self.q.shape[0], self.q.shape[1] // BLOCK)
        for name in ("d", "m"):
            value = getattr(self, name)
            if value.dtype != np.float16 or value.shape != blocks or not np.all(np.isfinite(value)):
                raise ValueError(f"{name} must be finite float16 {list(blocks)}, got {value.dtype} {value.shape}")

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: m + q * d, in float32 as llama.cpp and gguf dequantize."""
        n, k = self.q.shape
        q = self.q.reshape(n, -1, BLOCK).astype(np.float32)
        w = self.m.astype(np.float32)[..., None] + q * self.d.astype(np.float32)[..., None]
        return w.reshape(n, k)

    def pack(self) -> tuple[np.ndarray, np.ndarray]:
        """The op's (qs uint8 [N, ceil(nb / 2), 32], dm float16 [N, 2, nb])."""
        n, k = self.q.shape
        nb = k // BLOCK
        q = self.q.reshape(n, nb, BLOCK)
        if nb % 2:
            q = np.concatenate([q, np.zeros((n, 1, BLOCK), np.uint8)], axis=1)
        pairs = q.reshape(n, -1, 2, BLOCK)
        qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).astype(np.uint8)
        return np.ascontiguousarray(qs), np.ascontiguousarray(np.stack([self.d, self.m], axis=1))

    @classmethod
    def unpack(cls, qs: np.ndarray, dm: np.ndarray) -> Q4_1Weights:
        if dm.ndim != 3 or dm.dtype != np.float16 or dm.shape[1] != 2:
            raise ValueError(f"dm must be float16 [N, 2, nb], got {dm.dtype} {dm.shape}")
        n, _, nb = dm.shape
        if qs.dtype != np.uint8 or qs.shape != (n, -(-nb // 2), PAIR_BYTES):
            raise ValueError(f"qs must be uint8 [{n}, {-(-nb // 2)}, {PAIR_BYTES}] for dm {dm.shape}, "
                             f"got {qs.dtype} {qs.shape}")
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, -1)[:, : nb * BLOCK]
        return cls(np.ascontiguousarray(q), np.ascontiguousarray(dm[:, 0]), np.ascontiguousarray(dm[:, 1]))

    def pack_records(self) -> tuple[np.ndarray, np.ndarray]:
        """The op's records form: (qs uint8 [ceil(N / 16), nb, 320], dm float16 [N, 0])."""
        n, k = self.q.shape
        nb, groups = k // BLOCK, -(-n // GROUP)
        pad = ((0, groups * GROUP - n), (0, 0))
        # q [group, lane, block, chunk, low/high, i] -> bytes [group, block, chunk, lane, i]
        q = np.pad(self.q, pad).reshape(groups, GROUP, nb, CHUNKS, 2, 4)
        nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4).reshape(groups, nb, NIBBLE_BYTES)
        steps = [np.pad(v, pad).astype("<f2").reshape(groups, GROUP, nb).transpose(0, 2, 1) for v in (self.d, self.m)]
        step_bytes = np.ascontiguousarray(np.concatenate(steps, axis=2)).view(np.uint8)
        records = np.ascontiguousarray(np.concatenate([nibbles.astype(np.uint8), step_bytes], axis=2))
        return records, np.zeros((n, 0), np.float16)

    @classmethod
    def unpack_records(cls, qs: np.ndarray, dm: np.ndarray) -> Q4_1Weights:
        if dm.ndim != 2 or dm.dtype != np.float16 or dm.shape[1] != 0 or dm.shape[0] < 1:
            raise ValueError(f"dm must be float16 [N, 0] in the records layout, got {dm.dtype} {dm.shape}")
        n = dm.shape[0]
        groups = -(-n // GROUP)
        if qs.dtype != np.uint8 or qs.ndim != 3 or qs.shape[0] != groups or qs.shape[1] < 1 \
                or qs.shape[2] != RECORD_BYTES:
            raise ValueError(f"qs must be uint8 [{groups}, nb, {RECORD_BYTES}] records for N = {n}, "
                             f"got {qs.dtype} {qs.shape}")
        nb = qs.shape[1]
        nibbles = qs[..., :NIBBLE_BYTES].reshape(groups, nb, CHUNKS, GROUP, 4)
        # bytes [group, block, chunk, lane, i] -> q [group, lane, block, chunk, low/high, i]
        q = np.stack([nibbles & 15, nibbles >> 4], axis=-2).transpose(0, 3, 1, 2, 4, 5).reshape(groups * GROUP, -1)
        steps = np.ascontiguousarray(qs[..., NIBBLE_BYTES:]).view("<f2")  # [group, block, d lanes + m lanes]
        d, m = (steps[..., part].transpose(0, 2, 1).reshape(groups * GROUP, nb)[:n].astype(np.float16)
                for part in (slice(0, GROUP), slice(GROUP, 2 * GROUP)))
        return cls(np.ascontiguousarray(q[:n]), np.ascontiguousarray(d), np.ascontiguousarray(m))

    def pack_as(self, layout: str) -> tuple[np.ndarray, np.ndarray]:
        """The op's (qs, dm) in `layout` (BLOCKS or RECORDS)."""
        return self.pack_records() if check_layout(layout) == RECORDS else self.pack()

    @classmethod
    def unpack_as(cls, layout: str, qs: np.ndarray, dm: np.ndarray) -> Q4_1Weights:
        """The weights of the op's (qs, dm) in `layout`."""
        return cls.unpack_records(qs, dm) if check_layout(layout) == RECORDS else cls.unpack(qs, dm)


def node_layout(node: NodeProto) -> str:
    """A saved graph's kiln.MatMulQ4_1 node's weight layout, a kiln.MoE node's experts' or a kiln.MatMulGGUF node's
    (the same attribute, the same names: kiln/gguf_records.py): blocks when the attribute is absent (engines before
    records; float experts)."""
    found = next((a for a in node.attribute if a.name == LAYOUT), None)
    return BLOCKS if found is None else found.s.decode()


def node_centre(node: NodeProto) -> float:
    """A saved graph's kiln.MatMulQ4_1 node's centre, or a kiln.MoE node's Q4_1 experts' (CENTRE when absent)."""
    found = next((a for a in node.attribute if a.name == CENTRE_ATTRIBUTE), None)
    return CENTRE if found is None else float(found.f)


def check_centre(centre: float) -> float:
    if not 0.0 <= centre <= 15.0:
        raise ValueError(f"kiln.MatMulQ4_1's centre must be a code in [0, 15], got {centre!r}")
    return float(centre)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"kiln.MatMulQ4_1's layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


@dataclass(frozen=True)
class Int8Blocks:
    """Activations [T, K] quantized per block of 32 as the kernel does (llama.cpp's q8_1, exact sums)."""

    q: np.ndarray  # int8 [T, K]
    scale: np.ndarray  # float32 [T, K / 32]
    sums: np.ndarray  # float64 [T, K / 32]: sum of the block's float activations
    sum_errors: np.ndarray  # float64 [T, K / 32]: sums - scale * sum(q)


def quantize_activations(x: np.ndarray) -> Int8Blocks:
    """x float32 [T, K] (K a multiple of 32) -> its int8 blocks, in the kernel's float32 arithmetic."""
    x = np.asarray(x, dtype=np.float32)
    t, k = x.shape
    blocks = x.reshape(t, k // BLOCK, BLOCK)
    scale = (np.abs(blocks).max(axis=-1) / np.float32(INT8_MAX)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    sums = blocks.astype(np.float64).sum(axis=-1)
    return Int8Blocks(q.reshape(t, k), scale, sums, sums - scale * q.sum(axis=-1, dtype=np.int64))


def matmul_q4_1_ref(x: np.ndarray, qs: np.ndarray, dm: np.ndarray, bias: np.ndarray | None = None,
                    layout: str = BLOCKS, centre: float = CENTRE) -> np.ndarray:
    """y = x @ W^T of the op (int8 activations, Q4_1 weights in `layout`, the node's `centre`), float64
    accumulation; float32 [..., N]."""
    centre = check_centre(centre)
    w = Q4_1Weights.unpack_as(layout, qs, dm)
    n, k = w.q.shape
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension {x.shape[-1]} is not the weight's K = {k}")
    lead = x.shape[:-1]
    acts = quantize_activations(x.reshape(-1, k))
    t = acts.q.shape[0]
    # integer dots per (token, row, block), exact in int64
    dots: np.ndarray = np.einsum("tbi,nbi->tnb", acts.q.reshape(t, -1, BLOCK).astype(np.int64),
                     w.q.reshape(n, -1, BLOCK).astype(np.int64))
    d, m = w.d.astype(np.float64), w.m.astype(np.float64)
    y: np.ndarray = ((dots * d[None] * acts.scale.astype(np.float64)[:, None]).sum(-1) + acts.sums @ m.T
                     + centre * acts.sum_errors @ d.T)
    if bias is not None:
        y = y + bias.astype(np.float64)
    return y.astype(np.float32).reshape(*lead, n)


def make_single_op_model(weights: Q4_1Weights, bias: np.ndarray | None = None, rank: int = 2,
                         layout: str = BLOCKS, centre: float | None = None) -> ModelProto:
    """A one-node ONNX model y = kiln.MatMulQ4_1(x, qs, dm[, bias]) with constant weights in `layout` (and a centre
    attribute when given), for tests and benchmarks. x is [T, K] (rank 2) or [B, T, K] (rank 3), the leading dims
    symbolic."""
    from onnx import TensorProto, helper, numpy_helper  # compile-time dependency only

    n, k = weights.q.shape
    qs, dm = weights.pack_as(layout)
    lead = ["B", "T"][3 - rank:]
    inits = [numpy_helper.from_array(qs, "qs"), numpy_helper.from_array(dm, "dm")]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.astype(np.float32), "bias"))
    names = ["x", "qs", "dm"] + (["bias"] if bias is not None else [])
    attributes: dict[str, Any] = {LAYOUT: RECORDS} if layout == RECORDS else {}  # blocks: the default
    if centre is not None:
        attributes[CENTRE_ATTRIBUTE] = centre
    node = helper.make_node(OP_TYPE, names, ["y"], domain=OP_DOMAIN, **attributes)
    return single_node_model(node, "matmul_q4_1", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, k])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, n])], initializers=inits)
