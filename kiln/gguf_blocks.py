"""GGUF's quantized blocks (llama.cpp's ggml types) decoded to float32: the numbers kiln.MatMulGGUF multiplies by.

Each type stores a row of K weights as K / QK blocks of a fixed byte size, in the row's order:

    Q4_0  32 weights, 18 bytes: d f16, 16 bytes of nibbles   w = d * (q - 8)
          (byte i: weight i in its low nibble, weight 16 + i in its high one)
    Q5_0  32 weights, 22 bytes: d f16, 4 bytes of fifth bits (bit i of the little-endian word: weight i), Q4_0's
          16 bytes of nibbles                                 w = d * ((q | hb << 4) - 16)
    Q5_1  32 weights, 24 bytes: d f16, m f16, then Q5_0's fifth bits and nibbles
                                                             w = d * (q | hb << 4) + m
    Q8_0  32 weights, 34 bytes: d f16, 32 int8               w = d * q
    Q4_K  256 weights, 144 bytes: d f16, dmin f16, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
          128 bytes of nibbles (32 bytes hold sub-blocks 2c (low nibbles) and 2c + 1 (high))
                                                             w = (d * sc_j) * q - (dmin * m_j)
    Q5_K  256 weights, 176 bytes: Q4_K's d, dmin and scales, then 32 bytes of fifth bits (bit j of byte l: weight l
          of sub-block j), then Q4_K's nibbles                w = (d * sc_j) * (q | hb << 4) - (dmin * m_j)
    Q6_K  256 weights, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16
          weights), d f16                                    w = (d * sc) * (q - 32)

The arithmetic is llama.cpp's dequantize_row_* and gguf-py's dequantize in float32, operation for operation (the
scale products rounded to float32 first), so the decoded rows equal gguf-py's bit for bit
(tests/unit/test_matmul_gguf.py checks every type against gguf.quants.dequantize).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class GgmlType(IntEnum):
    """The ggml types kiln.MatMulGGUF executes, by their GGUF type ids (gguf.GGMLQuantizationType)."""

    Q4_0 = 2
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


@dataclass(frozen=True)
class BlockFormat:
    weights: int  # per block (QK)
    nbytes: int  # per block


FORMATS = {
    GgmlType.Q4_0: BlockFormat(32, 18),
    GgmlType.Q5_0: BlockFormat(32, 22),
    GgmlType.Q5_1: BlockFormat(32, 24),
    GgmlType.Q8_0: BlockFormat(32, 34),
    GgmlType.Q4_K: BlockFormat(256, 144),
    GgmlType.Q5_K: BlockFormat(256, 176),
    GgmlType.Q6_K: BlockFormat(256, 210),
}


def ggml_type(value: int) -> GgmlType:
    """The executable type of a GGUF type id; ValueError naming the supported ones otherwise."""
    try:
        return GgmlType(int(value))
    except ValueError:
        names = ", ".join(f"{t.name} ({t.value})" for t in GgmlType)
        raise ValueError(f"ggml type {value} has no kiln.MatMulGGUF kernel; supported: {names}") from None


def row_bytes(kind: GgmlType, k: int) -> int:
    """Bytes of one row of k weights; ValueError when k is not a whole number of blocks."""
    fmt = FORMATS[kind]
    if k <= 0 or k % fmt.weights:
        raise ValueError(f"{kind.name} rows hold whole blocks of {fmt.weights} weights, got K = {k}")
    return k // fmt.weights * fmt.nbytes


def row_weights(kind: GgmlType, nbytes: int) -> int:
    """K of a row of nbytes; ValueError when nbytes is not a whole number of blocks."""
    fmt = FORMATS[kind]
    if nbytes <= 0 or nbytes % fmt.nbytes:
        raise ValueError(f"{kind.name} rows are whole blocks of {fmt.nbytes} bytes, got {nbytes} bytes")
    return nbytes // fmt.nbytes * fmt.weights


def dequantize(blocks: np.ndarray, kind: GgmlType) -> np.ndarray:
    """uint8 [N, row bytes] (each row its blocks, in order) -> float32 [N, K]."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    if blocks.ndim != 2:
        raise ValueError(f"blocks must be uint8 [N, row bytes], got shape {list(blocks.shape)}")
    n, nbytes = blocks.shape
    k = row_weights(kind, nbytes)
    fmt = FORMATS[kind]
    flat = blocks.reshape(-1, fmt.nbytes)
    return _DECODERS[kind](flat).reshape(n, k)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[B, 2] bytes -> float32 [B, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d, qs = _f16(b[:, :2]), b[:, 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes of fifth bits and 16 of nibbles [B, ...] -> q 0..31 as uint8 [B, 32]: weight i < 16 is
    qs[i]'s low nibble, weight 16 + i its high one, each with bit i (16 + i) of the little-endian word qh."""
    word = np.ascontiguousarray(qh).view("<u4")  # [B, 1]
    high = ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q: np.ndarray = np.concatenate([qs & 15, qs >> 4], axis=1) | (high << 4)
    return q


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = _five_bits(b[:, 2:6], b[:, 6:22]).astype(np.int8) - np.int8(16)
    return _f16(b[:, :2]) * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _five_bits(b[:, 4:8], b[:, 8:24])
    w: np.ndarray = _f16(b[:, :2]) * q.astype(np.float32) + _f16(b[:, 2:4])
    return w


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes [B, 12] -> 6-bit (scales, mins), each uint8 [B, 8] (llama.cpp's get_scale_min_k4):
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11, their
    top two bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _k_affine(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """(d * sc_j) * q - (dmin * m_j) over 8 sub-blocks of 32, q uint8 [B, 256]."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_scales_mins(b[:, 4:16])
    scale = (d * sc.astype(np.float32))[..., None]
    minimum = (dmin * mn.astype(np.float32))[..., None]
    w: np.ndarray = scale * q.reshape(-1, 8, 32).astype(np.float32) - minimum
    return w.reshape(-1, 256)


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """128 bytes [B, 128] -> [B, 256] in sub-block order: chunk c's low nibbles, then its high ones."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 15, chunks >> 4], axis=2).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _k_affine(b, _nibbles_k(b[:, 16:144]))


def _q5_k_codes(b: np.ndarray) -> np.ndarray:
    """Q5_K blocks [B, 176] -> their 5-bit q as uint8 [B, 256]."""
    qh = b[:, 16:48]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [B, sub-block j, weight l]
    codes: np.ndarray = _nibbles_k(b[:, 48:176]) | (high.reshape(-1, 256) << 4)
    return codes


def _q5_k(b: np.ndarray) -> np.ndarray:
    return _k_affine(b, _q5_k_codes(b))


def q6_k_integers(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [B, 210] -> their 6-bit q (0..63, before the - 32) as uint8 [B, 256], in weight order."""
    ql, qh = b[:, 0:128].reshape(-1, 2, 1, 2, 32), b[:, 128:192].reshape(-1, 2, 1, 32)
    # half h (128 weights) = groups t = 0..3 of 32: low nibbles of ql[64h + 32 (t % 2) + l] shifted by 4 (t // 2),
    # high bits 2t..2t+1 of qh[32h + l]
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q: np.ndarray = (low | (high << 4)).reshape(-1, 256)
    return q


def _q6_k(b: np.ndarray) -> np.ndarray:
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    q = q6_k_integers(b).astype(np.int8) - np.int8(32)
    w: np.ndarray = (d * scales)[..., None] * q.reshape(-1, 16, 16).astype(np.float32)
    return w.reshape(-1, 256)


@dataclass(frozen=True)
class BlockIntegers:
    """A matrix's blocks as integers and float32 steps: w = d * scale_s * q (- dmin * min_j) per sub-block s of each
    block (the int8-activation path's terms, kiln/gguf_int8.py)."""

    q: np.ndarray  # int16 [N, nb, S, L]: the codes, offsets applied (Q4_0: q - 8, Q6_K: q - 32); S sub-blocks of L
    scales: np.ndarray  # int16 [N, nb, S]: each sub-block's integer scale (1 for Q4_0, Q8_0)
    mins: np.ndarray | None  # int16 [N, nb, 8]: Q4_K / Q5_K's minimums of the 8 sub-blocks, else None
    d: np.ndarray  # float32 [N, nb]
    dmin: np.ndarray | None  # float32 [N, nb]: Q4_K / Q5_K only


def block_integers(blocks: np.ndarray, kind: GgmlType) -> BlockIntegers:
    """uint8 [N, row bytes] -> the blocks' integers (layouts as `dequantize` reads them)."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    n = blocks.shape[0]
    fmt = FORMATS[kind]
    b = blocks.reshape(-1, fmt.nbytes)
    nb = b.shape[0] // max(n, 1)
    mins = dmin = None
    if kind in (GgmlType.Q4_0, GgmlType.Q8_0):
        qs = b[:, 2:]
        q = (np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int16) - 8 if kind == GgmlType.Q4_0
             else np.ascontiguousarray(qs).view(np.int8).astype(np.int16))
        q, scales, d = q.reshape(-1, 1, 32), np.ones((b.shape[0], 1), np.int16), _f16(b[:, :2])
    elif kind == GgmlType.Q6_K:
        q = (q6_k_integers(b).astype(np.int16) - 32).reshape(-1, 16, 16)
        scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.int16)
        d = _f16(b[:, 208:210])
    else:
        codes = _nibbles_k(b[:, 16:144]) if kind == GgmlType.Q4_K else _q5_k_codes(b)
        q, d, dmin = codes.astype(np.int16).reshape(-1, 8, 32), _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = k_scales_mins(b[:, 4:16])
        scales, mins = sc.astype(np.int16), mn.astype(np.int16).reshape(n, nb, 8)
        dmin = dmin.reshape(n, nb)
    return BlockIntegers(q.reshape(n, nb, *q.shape[1:]), scales.reshape(n, nb, -1), mins, d.reshape(n, nb), dmin)


def random_blocks(rng: np.random.Generator, kind: GgmlType, rows: int, cols: int, std: float = 0.05) -> np.ndarray:
    """uint8 [rows, row bytes] of random valid blocks whose weights have about this std (for tests and benchmarks):
    random bytes, then the float16 steps (d, and dmin for Q4_K / Q5_K) set to give that size, each block's varied
    by up to 2x so that a misplaced step shows."""
    fmt = FORMATS[kind]
    nb = row_bytes(kind, cols) // fmt.nbytes
    blocks = rng.integers(0, 256, (rows, nb, fmt.nbytes), dtype=np.uint8)
    offsets = [208] if kind == GgmlType.Q6_K else [0, 2] if kind in _WITH_MINIMUMS else [0]

    def set_steps(values: np.ndarray) -> None:
        for offset in offsets:
            blocks[:, :, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)

    set_steps(np.ones((rows, nb), np.float32))
    unit = float(dequantize(blocks.reshape(rows, -1), kind).std())
    set_steps((std / unit) * rng.uniform(0.5, 1.0, (rows, nb)).astype(np.float32))
    return blocks.reshape(rows, -1)


_WITH_MINIMUMS = (GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q5_1)  # a second f16 step after d (dmin, or Q5_1's m)
_DECODERS = {
    GgmlType.Q4_0: _q4_0,
    GgmlType.Q5_0: _q5_0,
    GgmlType.Q5_1: _q5_1,
    GgmlType.Q8_0: _q8_0,
    GgmlType.Q4_K: _q4_k,
    GgmlType.Q5_K: _q5_k,
    GgmlType.Q6_K: _q6_k,
}
