"""kiln.MatMulGGUF's Q4_K, Q5_K, Q6_K and Q8_0 weights as records (attribute ``layout = "records"``): the layouts and
their executable specs.

The CPU kernels (runtime/ops/q4_k_records.h, q5_k_records.h, q6_k_records.h, q8_0_records.h, on kiln.MatMulQ4_1's
tile) are tested against `matmul_records_ref`.

Q4_K

A Q4_K superblock of 256 inputs is 8 blocks of 32 with ``w = (d * sc_j) * q - (dmin * m_j)`` (q the 4-bit code,
sc_j and m_j 6-bit integers, d and dmin float16): per block of 32, a Q4_1 block whose step is the float32 product
``d * sc_j`` and whose minimum is ``-(dmin * m_j)``. The records hold the file's numbers in kiln.MatMulQ4_1's
record layout, 8 blocks at a time, so the kernel is MatMulQ4_1's: 16 output channels in the lanes of a vector, a
64-byte chunk of nibbles the operand of vpdpbusd against 4 int8 of a row, and activations quantized per block of 32.

Layout ``records`` (ggml_type Q4_K, Q5_K, Q6_K or Q8_0 with int8_activations = 1, N a multiple of 16, K of 256)
  w   uint8 [N / 16, K / 256, 2368]   record (g, b): channels 16g .. 16g + 15 ("lanes" l), superblock b
Record bytes
  256 s + 64 j + 4 l + i   (s, j < 8, 4; i < 4): channel l's input 256b + 32s + 8j + i in the low nibble and
                           256b + 32s + 8j + 4 + i in the high one (kiln.MatMulQ4_1's record for block s)
  2048 + 16 s + l          sc_s of channel l (the 6-bit scale, one byte)
  2176 + 16 s + l          m_s of channel l (the 6-bit minimum, one byte)
  2304 + 2 l, 2336 + 2 l   d, dmin of channel l (float16, little-endian)
2368 bytes are 37 cache lines: 148 bytes per channel and superblock against the file's 144 (the scales a byte each
instead of 6 bits: 2.8% more bytes for no unpacking of 12-byte scale fields in the kernel).

Semantics: kiln.MatMulQ4_1's (kiln/matmul_q4_1.py) with these steps and minimums. Each row of x is quantized per
block of 32 to int8 (``xs = max|x_block| / 127``, ``xq = rint(x / xs)``), with ``S = sum(x_block)`` and
``E = S - xs * sum(xq)``; per block of 32 with ``D = d * sc_j`` and ``M = dmin * m_j`` (float32 products):

    y[t, n] = sum_blocks  D * xs * (q . xq)  +  7.5 * D * E  -  M * S   (+ bias[n])

The weights are the file's exactly; only the activations are rounded, per 32 values where the ``blocks`` layout's
int8 path (kiln/gguf_int8.py) rounds per 256 with its sub-block sums. The kernel sums in float32 (per lane, blocks
in order), this spec in float64. A row's outputs are bitwise the same for every number of rows beside it.

Q5_K
----
Q5_K is Q4_K with a fifth bit on each code (q 0..31). Its records (``w uint8 [N / 16, K / 256, 2880]``) are Q4_K's
with the fifth bits inserted after the nibbles: byte 2048 + 64 s + 4 l + i holds, at bit 2j, the fifth bit of
channel l's input 32s + 8j + i (the low nibble of byte 256 s + 64 j + 4 l + i) and at bit 2j + 1 that of input
32s + 8j + 4 + i (its high nibble); then sc, m, d, dmin as Q4_K's at 2560, 2688, 2816, 2848 (180 bytes per channel
and superblock against the file's 176). Semantics: Q4_K's with the codes' mean 15.5 in place of 7.5.

Q6_K
----
A Q6_K superblock is 16 groups of 16 with ``w = (d * sc_g) * (q - 32)``, q a 6-bit code, sc_g an int8 scale, d
float16. Its records (``w uint8 [N / 16, K / 256, 3392]``) put 16 channels in the lanes the same way: per block s
of 32 inputs the low nibbles as Q4_1's record (bytes 256 s + 64 j + 4 l + i, inputs 32s + 8j + i low and
32s + 8j + 4 + i high), then the high 2 bits (bytes 2048 + 128 s + 64 h + 4 l + i: bits 0-1, 2-3, 4-5, 6-7 are those
of inputs 32s + 16h + i, + 4 + i, + 8 + i, + 12 + i), then ``sc_g`` of lane l at 3072 + 16 g + l (int8), d at
3328 + 2 l (float16) and 32 zero bytes (a record is 53 cache lines: 212 bytes per channel and superblock against the
file's 210). Semantics: x quantized per block of 32 as for Q4_K, and per group of 16 with ``D = d * sc_g`` (float32)

    y[t, n] = sum_groups  D * (xs * ((q - 32) . xq))   (+ bias[n])

the offset of 32 exact in integers (the codes are centred already, as in the blocks layout's int8 path).

Q8_0
----
Q8_0 is blocks of 32 int8 codes with ``w = d * q``, d float16. Its records (``w uint8 [N / 16, K / 256, 4352]``, K a
multiple of 256) hold 8 blocks of 16 channels: per block s the codes plus 128 as bytes (the unsigned operand of
vpdpbusd), byte 512 s + 64 j + 4 l + i holding channel l's input 32s + 4j + i, then d of block s, lane l at
4096 + 32 s + 2 l (float16): 68 cache lines, 272 bytes per channel and superblock, the file's own. Semantics: x
quantized per block of 32 as for Q4_K (the blocks layout's int8 path quantizes Q8_0's activations the same way), and

    y[t, n] = sum_blocks  d * (xs * (q . xq))   (+ bias[n])

the kernel's offset of 128 removed exactly with the row's int sums of 16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.gguf_blocks import FORMATS, BlockIntegers, GgmlType, block_integers, q6_k_integers, row_weights
from kiln.matmul_q4_1 import CENTRE, GROUP, quantize_activations

LAYOUT = "layout"  # the attribute, as kiln.MatMulQ4_1's
BLOCKS = "blocks"  # w [N, row bytes]: the file's bytes; the default
RECORDS = "records"  # w [N / 16, K / 256, 2368 (Q4_K), 2880 (Q5_K), 3392 (Q6_K) or 4352 (Q8_0)]
LAYOUTS = (BLOCKS, RECORDS)
SUPER = 256  # inputs per Q4_K superblock
SUBS = 8  # blocks of 32 a superblock
CHUNKS = 4  # a block's 64-byte chunks
BLOCK_BYTES = CHUNKS * GROUP * 4  # 256
SCALES = SUBS * BLOCK_BYTES  # 2048: sc[s][l]
MINS = SCALES + SUBS * GROUP  # 2176: m[s][l]
D = MINS + SUBS * GROUP  # 2304: d[l], float16
DMIN = D + 2 * GROUP  # 2336: dmin[l], float16
RECORD_BYTES = DMIN + 2 * GROUP  # 2368
Q4_K_BYTES = FORMATS[GgmlType.Q4_K].nbytes  # 144
Q6_HIGH = SUBS * BLOCK_BYTES  # 2048: the high bits, 128 bytes a block
Q6_SCALES = Q6_HIGH + SUBS * 128  # 3072: sc[16][l], int8
Q6_D = Q6_SCALES + 2 * SUBS * GROUP  # 3328: d[l], float16
Q6_RECORD_BYTES = Q6_D + 2 * GROUP + 32  # 3392, with 32 bytes of padding
Q6_K_BYTES = FORMATS[GgmlType.Q6_K].nbytes  # 210
Q5_HIGH = SCALES  # 2048: the fifth bits, 64 bytes a block
Q5_SCALES = Q5_HIGH + SUBS * CHUNKS * GROUP  # 2560: then Q4_K's sc, m, d, dmin
Q5_RECORD_BYTES = Q5_SCALES + (RECORD_BYTES - SCALES)  # 2880
Q5_K_BYTES = FORMATS[GgmlType.Q5_K].nbytes  # 176
Q5_CENTRE = 15.5  # the mean of 5-bit codes
Q8_BLOCK_BYTES = 8 * GROUP * 4  # 512: a block's codes, a byte each
Q8_D = SUBS * Q8_BLOCK_BYTES  # 4096: d[s][l], float16
Q8_RECORD_BYTES = Q8_D + SUBS * GROUP * 2  # 4352
Q8_0_BYTES = FORMATS[GgmlType.Q8_0].nbytes  # 34
Q8_OFFSET = 128  # added to the int8 codes: vpdpbusd's unsigned operand
# the record types an older op library (ABI 12) lacks: an engine holding them needs ABI 14
ABI_14_KINDS = frozenset({GgmlType.Q5_K, GgmlType.Q8_0})


def records_shape(kind: int, n: int, k: int) -> tuple[int, int, int]:
    return (n // GROUP, k // SUPER, RECORD_FORMATS[GgmlType(kind)].record_bytes)


def can_pack(kind: int, int8_activations: bool, n: int, k: int) -> bool:
    """Whether a kiln.MatMulGGUF node of this type, activation path, N output channels and K inputs may hold
    records (whole superblocks of 256 inputs: always for the k-quants, K a multiple of 256 for Q8_0)."""
    return kind in RECORD_KINDS and int8_activations and n > 0 and n % GROUP == 0 and k % SUPER == 0


def pack_records(blocks: np.ndarray, kind: int) -> np.ndarray:
    """A matrix of Q4_K, Q5_K, Q6_K or Q8_0 blocks as the file holds them -> its records."""
    return RECORD_FORMATS[_record_kind(kind)].pack(blocks)


def unpack_records(records: np.ndarray, kind: int) -> np.ndarray:
    """The records' matrix as the file holds it, bit for bit."""
    return RECORD_FORMATS[_record_kind(kind)].unpack(records)


def matmul_records_ref(x: np.ndarray, records: np.ndarray, kind: int, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W^T of kiln.MatMulGGUF with records of `kind`, float64 sums; float32 [..., N]."""
    return RECORD_FORMATS[_record_kind(kind)].spec(x, records, bias)


def _record_kind(kind: int) -> GgmlType:
    if kind not in RECORD_KINDS:
        names = ", ".join(k.name for k in RECORD_FORMATS)
        raise ValueError(f"ggml type {kind} has no records layout; records hold {names}")
    return GgmlType(kind)


def pack_q4_k_records(blocks: np.ndarray) -> np.ndarray:
    """A Q4_K matrix as the file holds it (uint8 [N, K / 256 * 144], N a multiple of 16) -> its records."""
    blocks = _check_blocks(blocks)
    n, nb = blocks.shape[0], blocks.shape[1] // Q4_K_BYTES
    b = blocks.reshape(n, nb, Q4_K_BYTES)
    ints = block_integers(blocks, GgmlType.Q4_K)
    groups = n // GROUP
    # codes [group, lane, super, s, chunk, low/high, i] -> bytes [group, super, s, chunk, lane, i]
    q = ints.q.astype(np.uint8).reshape(groups, GROUP, nb, SUBS, CHUNKS, 2, 4)
    nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(0, 2, 3, 4, 1, 5).reshape(groups, nb, SCALES)

    def lanes_last(v: np.ndarray) -> np.ndarray:  # [N, nb, ...] -> [groups, nb, ..., lane]
        v = v.reshape(groups, GROUP, nb, -1)
        return v.transpose(0, 2, 3, 1).reshape(groups, nb, -1)

    sc = lanes_last(ints.scales.astype(np.uint8))
    assert ints.mins is not None
    mn = lanes_last(ints.mins.astype(np.uint8))
    # float16 bytes [N, nb, 2] -> [groups, nb, lane, 2]
    d, dmin = (b[:, :, part].reshape(groups, GROUP, nb, 2).transpose(0, 2, 1, 3).reshape(groups, nb, 2 * GROUP)
               for part in (slice(0, 2), slice(2, 4)))
    return np.ascontiguousarray(np.concatenate([nibbles, sc, mn, d, dmin], axis=2))


def unpack_q4_k_records(records: np.ndarray) -> np.ndarray:
    """The records' Q4_K matrix as the file holds it, bit for bit: uint8 [N, K / 256 * 144]."""
    records = _check_records(records)
    groups, nb = records.shape[:2]
    n = groups * GROUP
    raw = records[..., :SCALES].reshape(groups, nb, SUBS, CHUNKS, GROUP, 4)
    # bytes [group, super, s, chunk, lane, i] -> codes [group, lane, super, s, chunk, low/high, i]
    q = np.stack([raw & 15, raw >> 4], axis=-2).transpose(0, 4, 1, 2, 3, 5, 6).reshape(n, nb, SUBS, 32)

    def per_channel(part: np.ndarray, width: int) -> np.ndarray:  # [groups, nb, width * 16] -> [N, nb, width]
        return part.reshape(groups, nb, width, GROUP).transpose(0, 3, 1, 2).reshape(n, nb, width)

    sc = per_channel(records[..., SCALES:MINS], SUBS)
    mn = per_channel(records[..., MINS:D], SUBS)
    d = records[..., D:DMIN].reshape(groups, nb, GROUP, 2).transpose(0, 2, 1, 3).reshape(n, nb, 2)
    dmin = records[..., DMIN:].reshape(groups, nb, GROUP, 2).transpose(0, 2, 1, 3).reshape(n, nb, 2)
    # llama.cpp's 12 bytes of 6-bit scales and minimums (the inverse of gguf_blocks.k_scales_mins)
    scales = np.concatenate([
        (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
        (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4),
    ], axis=2)
    # codes in the file's order: chunk c of 32 bytes holds block 2c in the low nibbles and 2c + 1 in the high ones
    pairs = q.reshape(n, nb, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, nb, 128)
    blocks = np.concatenate([d, dmin, scales.astype(np.uint8), qs.astype(np.uint8)], axis=2)
    return np.ascontiguousarray(blocks.reshape(n, nb * Q4_K_BYTES))


def matmul_q4_k_records_ref(x: np.ndarray, records: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W^T of kiln.MatMulGGUF with Q4_K records (see the module docstring), float64 sums; float32 [..., N]."""
    return _k_affine_records_ref(x, records, GgmlType.Q4_K, CENTRE, bias)


def _k_affine_records_ref(x: np.ndarray, records: np.ndarray, kind: GgmlType, centre: float,
                          bias: np.ndarray | None) -> np.ndarray:
    """Q4_K's and Q5_K's records spec: per block of 32, a Q4_1-like block with the codes' mean `centre`."""
    x, ints, n, k = _spec_inputs(x, records, kind)
    assert ints.mins is not None and ints.dmin is not None
    steps = (ints.d[..., None] * ints.scales.astype(np.float32)).astype(np.float32).reshape(n, -1)  # D [N, K / 32]
    mins = (ints.dmin[..., None] * ints.mins.astype(np.float32)).astype(np.float32).reshape(n, -1)  # M
    acts = quantize_activations(x.reshape(-1, k))
    t = acts.q.shape[0]
    dots = np.einsum("tbi,nbi->tnb", acts.q.reshape(t, -1, 32).astype(np.int64),
                     ints.q.reshape(n, -1, 32).astype(np.int64))
    d64, m64 = steps.astype(np.float64), mins.astype(np.float64)
    y = ((dots * d64[None] * acts.scale.astype(np.float64)[:, None]).sum(-1) + centre * acts.sum_errors @ d64.T
         - acts.sums @ m64.T)
    if bias is not None:
        y = y + bias.astype(np.float64)
    out: np.ndarray = y.astype(np.float32).reshape(*x.shape[:-1], n)
    return out


def pack_q5_k_records(blocks: np.ndarray) -> np.ndarray:
    """A Q5_K matrix as the file holds it (uint8 [N, K / 256 * 176], N a multiple of 16) -> its records: Q4_K's records
    of its d, dmin, scales and low nibbles, with the fifth bits inserted."""
    blocks = _check_blocks(blocks, "Q5_K", Q5_K_BYTES)
    n, nb = blocks.shape[0], blocks.shape[1] // Q5_K_BYTES
    groups = n // GROUP
    b = blocks.reshape(n, nb, Q5_K_BYTES)
    q4_k = np.concatenate([b[..., :16], b[..., 48:]], axis=2).reshape(n, -1)  # the file's Q4_K fields
    records = pack_q4_k_records(q4_k)
    top = (block_integers(blocks, GgmlType.Q5_K).q >> 4).astype(np.uint8)  # [N, nb, 8, 32]
    top = top.reshape(groups, GROUP, nb, SUBS, CHUNKS, 2, 4)  # [group, lane, super, s, j, low/high nibble, i]
    bits = sum(top[..., j, half, :] << (2 * j + half) for j in range(CHUNKS) for half in range(2))
    high = np.asarray(bits, np.uint8).transpose(0, 2, 3, 1, 4).reshape(groups, nb, Q5_SCALES - Q5_HIGH)
    return np.ascontiguousarray(np.concatenate([records[..., :SCALES], high, records[..., SCALES:]], axis=2))


def unpack_q5_k_records(records: np.ndarray) -> np.ndarray:
    """The records' Q5_K matrix as the file holds it, bit for bit: uint8 [N, K / 256 * 176]."""
    records = _check_records(records, "Q5_K", Q5_RECORD_BYTES)
    groups, nb = records.shape[:2]
    n = groups * GROUP
    q4_k = unpack_q4_k_records(np.concatenate([records[..., :Q5_HIGH], records[..., Q5_SCALES:]], axis=2))
    high = records[..., Q5_HIGH:Q5_SCALES].reshape(groups, nb, SUBS, GROUP, 4)  # [group, super, s, lane, i]
    top = np.stack([(high >> (2 * j + half)) & 1 for j in range(CHUNKS) for half in range(2)], axis=-2)
    top = top.transpose(0, 3, 1, 2, 4, 5).reshape(n, nb, SUBS, 32)  # [.., s, 8j + 4 half + i]: input order
    # the file's qh: bit j of byte l is the fifth bit of weight 32 j + l
    qh = np.zeros((n, nb, 32), np.uint8)
    for j in range(SUBS):
        qh |= top[:, :, j, :].astype(np.uint8) << j
    b = q4_k.reshape(n, nb, Q4_K_BYTES)
    return np.ascontiguousarray(np.concatenate([b[..., :16], qh, b[..., 16:]], axis=2).reshape(n, nb * Q5_K_BYTES))


def matmul_q5_k_records_ref(x: np.ndarray, records: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W^T of kiln.MatMulGGUF with Q5_K records (see the module docstring), float64 sums; float32 [..., N]."""
    return _k_affine_records_ref(x, records, GgmlType.Q5_K, Q5_CENTRE, bias)


def pack_q6_k_records(blocks: np.ndarray) -> np.ndarray:
    """A Q6_K matrix as the file holds it (uint8 [N, K / 256 * 210], N a multiple of 16) -> its records."""
    blocks = _check_blocks(blocks, "Q6_K", Q6_K_BYTES)
    n, nb = blocks.shape[0], blocks.shape[1] // Q6_K_BYTES
    groups = n // GROUP
    b = blocks.reshape(n, nb, Q6_K_BYTES)
    codes = q6_k_integers(b.reshape(-1, Q6_K_BYTES)).reshape(groups, GROUP, nb, SUBS, 32)  # 0..63, input order
    low = (codes & 15).reshape(groups, GROUP, nb, SUBS, CHUNKS, 2, 4)
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).transpose(0, 2, 3, 4, 1, 5).reshape(groups, nb, Q6_HIGH)
    # the high 2 bits of block s, input 16h + 4u + i (u = 0..3) -> bits 2u of byte [h, lane, i]
    top = (codes >> 4).reshape(groups, GROUP, nb, SUBS, 2, 4, 4)  # [.., s, h, u, i]
    high = (top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6))
    high = high.transpose(0, 2, 3, 4, 1, 5).reshape(groups, nb, SUBS * 128)  # [group, nb, s, h, lane, i]
    scales = b[:, :, 192:208].reshape(groups, GROUP, nb, 16).transpose(0, 2, 3, 1).reshape(groups, nb, 16 * GROUP)
    d = b[:, :, 208:210].reshape(groups, GROUP, nb, 2).transpose(0, 2, 1, 3).reshape(groups, nb, 2 * GROUP)
    pad = np.zeros((groups, nb, 32), np.uint8)
    return np.ascontiguousarray(np.concatenate([nibbles, high, scales, d, pad], axis=2).astype(np.uint8))


def unpack_q6_k_records(records: np.ndarray) -> np.ndarray:
    """The records' Q6_K matrix as the file holds it, bit for bit: uint8 [N, K / 256 * 210]."""
    records = _check_records(records, "Q6_K", Q6_RECORD_BYTES)
    groups, nb = records.shape[:2]
    n = groups * GROUP
    raw = records[..., :Q6_HIGH].reshape(groups, nb, SUBS, CHUNKS, GROUP, 4)
    low = np.stack([raw & 15, raw >> 4], axis=-2).transpose(0, 4, 1, 2, 3, 5, 6).reshape(n, nb, SUBS, 32)
    high = records[..., Q6_HIGH:Q6_SCALES].reshape(groups, nb, SUBS, 2, GROUP, 4)
    top = np.stack([(high >> (2 * u)) & 3 for u in range(4)], axis=-2)  # [group, nb, s, h, lane, u, i]
    top = top.transpose(0, 4, 1, 2, 3, 5, 6).reshape(n, nb, SUBS, 32)
    codes = (low | (top << 4)).reshape(n, nb, 2, 4, 32)  # [.., half, t, l]: input 128 half + 32 t + l
    # the file's ql / qh (the inverse of gguf_blocks.q6_k_integers)
    ql = ((codes[:, :, :, 0:2] & 15) | ((codes[:, :, :, 2:4] & 15) << 4)).reshape(n, nb, 128)
    qh = sum((codes[:, :, :, t] >> 4) << (2 * t) for t in range(4)).reshape(n, nb, 64)
    scales = records[..., Q6_SCALES:Q6_D].reshape(groups, nb, 16, GROUP).transpose(0, 3, 1, 2).reshape(n, nb, 16)
    d = records[..., Q6_D:Q6_D + 2 * GROUP].reshape(groups, nb, GROUP, 2).transpose(0, 2, 1, 3).reshape(n, nb, 2)
    blocks = np.concatenate([ql, qh, scales, d], axis=2).astype(np.uint8)
    return np.ascontiguousarray(blocks.reshape(n, nb * Q6_K_BYTES))


def matmul_q6_k_records_ref(x: np.ndarray, records: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W^T of kiln.MatMulGGUF with Q6_K records (see the module docstring), float64 sums; float32 [..., N]."""
    x, ints, n, k = _spec_inputs(x, records, GgmlType.Q6_K)  # q - 32 [N, nb, 16, 16], scales [N, nb, 16], d [N, nb]
    steps = (ints.d[..., None] * ints.scales.astype(np.float32)).astype(np.float32).reshape(n, -1)  # D [N, K / 16]
    acts = quantize_activations(x.reshape(-1, k))
    t = acts.q.shape[0]
    dots = np.einsum("tgi,ngi->tng", acts.q.reshape(t, -1, 16).astype(np.int64),
                     ints.q.reshape(n, -1, 16).astype(np.int64))
    xs = np.repeat(acts.scale.astype(np.float64), 2, axis=1)  # a block of 32's step for its two groups
    y = (dots * steps.astype(np.float64)[None] * xs[:, None]).sum(-1)
    if bias is not None:
        y = y + bias.astype(np.float64)
    out: np.ndarray = y.astype(np.float32).reshape(*x.shape[:-1], n)
    return out


def pack_q8_0_records(blocks: np.ndarray) -> np.ndarray:
    """A Q8_0 matrix as the file holds it (uint8 [N, K / 32 * 34], N a multiple of 16, K of 256) -> its records."""
    blocks = _check_blocks(blocks, "Q8_0", Q8_0_BYTES)
    n, blocks_per_row = blocks.shape[0], blocks.shape[1] // Q8_0_BYTES
    if blocks_per_row % SUBS:
        raise ValueError(f"Q8_0 records need K a multiple of {SUPER}, got {blocks_per_row * 32}")
    groups, nb = n // GROUP, blocks_per_row // SUBS
    b = blocks.reshape(groups, GROUP, nb, SUBS, Q8_0_BYTES)
    # codes [group, lane, super, s, chunk, i] -> bytes [group, super, s, chunk, lane, i]
    codes = (b[..., 2:] ^ np.uint8(Q8_OFFSET)).reshape(groups, GROUP, nb, SUBS, 8, 4)
    codes = codes.transpose(0, 2, 3, 4, 1, 5).reshape(groups, nb, Q8_D)
    d = b[..., :2].transpose(0, 2, 3, 1, 4).reshape(groups, nb, SUBS * GROUP * 2)  # [group, super, s, lane, 2]
    return np.ascontiguousarray(np.concatenate([codes, d], axis=2))


def unpack_q8_0_records(records: np.ndarray) -> np.ndarray:
    """The records' Q8_0 matrix as the file holds it, bit for bit: uint8 [N, K / 32 * 34]."""
    records = _check_records(records, "Q8_0", Q8_RECORD_BYTES)
    groups, nb = records.shape[:2]
    codes = records[..., :Q8_D].reshape(groups, nb, SUBS, 8, GROUP, 4).transpose(0, 4, 1, 2, 3, 5)
    codes = codes.reshape(groups, GROUP, nb, SUBS, 32) ^ np.uint8(Q8_OFFSET)
    d = records[..., Q8_D:].reshape(groups, nb, SUBS, GROUP, 2).transpose(0, 3, 1, 2, 4)
    blocks = np.concatenate([d, codes], axis=-1)
    return np.ascontiguousarray(blocks.reshape(groups * GROUP, nb * SUBS * Q8_0_BYTES))


def matmul_q8_0_records_ref(x: np.ndarray, records: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W^T of kiln.MatMulGGUF with Q8_0 records (see the module docstring), float64 sums; float32 [..., N]."""
    x, ints, n, k = _spec_inputs(x, records, GgmlType.Q8_0)  # q [N, K / 32, 1, 32], d [N, K / 32]
    acts = quantize_activations(x.reshape(-1, k))
    t = acts.q.shape[0]
    dots = np.einsum("tbi,nbi->tnb", acts.q.reshape(t, -1, 32).astype(np.int64),
                     ints.q.reshape(n, -1, 32).astype(np.int64))
    y = (dots * ints.d.astype(np.float64)[None] * acts.scale.astype(np.float64)[:, None]).sum(-1)
    if bias is not None:
        y = y + bias.astype(np.float64)
    out: np.ndarray = y.astype(np.float32).reshape(*x.shape[:-1], n)
    return out


@dataclass(frozen=True)
class RecordFormat:
    """A ggml type's records: their bytes a superblock of a 16-channel group, and the layout's codec and spec."""

    record_bytes: int
    pack: Callable[[np.ndarray], np.ndarray]
    unpack: Callable[[np.ndarray], np.ndarray]
    spec: Callable[[np.ndarray, np.ndarray, np.ndarray | None], np.ndarray]


RECORD_FORMATS = {
    GgmlType.Q4_K: RecordFormat(RECORD_BYTES, pack_q4_k_records, unpack_q4_k_records, matmul_q4_k_records_ref),
    GgmlType.Q5_K: RecordFormat(Q5_RECORD_BYTES, pack_q5_k_records, unpack_q5_k_records, matmul_q5_k_records_ref),
    GgmlType.Q6_K: RecordFormat(Q6_RECORD_BYTES, pack_q6_k_records, unpack_q6_k_records, matmul_q6_k_records_ref),
    GgmlType.Q8_0: RecordFormat(Q8_RECORD_BYTES, pack_q8_0_records, unpack_q8_0_records, matmul_q8_0_records_ref),
}
RECORD_KINDS = frozenset(RECORD_FORMATS)  # the types that have records


def _spec_inputs(x: np.ndarray, records: np.ndarray, kind: GgmlType) -> tuple[np.ndarray, BlockIntegers, int, int]:
    """(x as float32, the records' block integers, N, K), x's last dimension checked against K."""
    blocks = unpack_records(records, kind)
    n, k = blocks.shape[0], row_weights(kind, blocks.shape[1])
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension {x.shape[-1]} is not the weight's K = {k}")
    return x, block_integers(blocks, kind), n, k


def _check_blocks(blocks: np.ndarray, name: str = "Q4_K", nbytes: int = Q4_K_BYTES) -> np.ndarray:
    if blocks.ndim != 2 or blocks.dtype != np.uint8 or blocks.shape[1] % nbytes or blocks.shape[0] % GROUP \
            or not blocks.size:
        raise ValueError(f"{name} records need uint8 [N, K / 256 * {nbytes}] blocks with N a multiple of "
                         f"{GROUP}, got {blocks.dtype} {list(blocks.shape)}")
    return np.ascontiguousarray(blocks)


def _check_records(records: np.ndarray, name: str = "Q4_K", nbytes: int = RECORD_BYTES) -> np.ndarray:
    if records.ndim != 3 or records.dtype != np.uint8 or records.shape[2] != nbytes or not records.size:
        raise ValueError(f"{name} records must be uint8 [N / 16, K / 256, {nbytes}], got {records.dtype} "
                         f"{list(records.shape)}")
    return np.ascontiguousarray(records)
