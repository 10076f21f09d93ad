"""Reference numpy quantizers: the executable spec every ONNX quantization pass is tested against.

All weights are in the nn.Linear orientation ``w [N, K]`` (out_features, in_features); groups
run along K (the reduction axis), which is what ``com.microsoft::MatMulNBits`` expects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import numpy as np

from kiln.matmul_q4_1 import BLOCK, Q4_1Weights

# Rows quantized at once: every quantizer here works row by row, so slabs of rows give the same bits as the
# whole matrix while numpy's temporaries stay a few times 16 MB (an 8B model's embedding is 2 GB of fp32).
SLAB_ELEMENTS = 1 << 22
_Rows = TypeVar("_Rows")


def by_row_slabs(quantize: Callable[[np.ndarray], _Rows], w: np.ndarray) -> _Rows:
    """quantize(w) computed on slabs of rows and stacked (quantize must treat rows independently and return a
    dataclass whose array fields have rows first; other fields must agree across slabs)."""
    n, k = w.shape
    step = max(1, SLAB_ELEMENTS // max(k, 1))
    if n <= step:
        return quantize(w)
    parts = [quantize(w[start:start + step]) for start in range(0, n, step)]
    merged = {}
    for f in fields(parts[0]):  # type: ignore[arg-type]
        values = [getattr(p, f.name) for p in parts]
        merged[f.name] = np.concatenate(values, axis=0) if isinstance(values[0], np.ndarray) else values[0]
    return type(parts[0])(**merged)


@dataclass(frozen=True)
class GroupQuantized:
    """``w ≈ (q - zero_points) * scales`` group-wise along K. q is padded to whole groups."""

    q: np.ndarray  # uint8 [N, n_groups * group_size], values in [0, 2**bits - 1]
    scales: np.ndarray  # float32 [N, n_groups]
    zero_points: np.ndarray  # uint8 [N, n_groups]
    bits: int
    group_size: int
    k: int  # the real (unpadded) K

    def dequantize(self) -> np.ndarray:
        n, _ = self.q.shape
        groups = self.q.reshape(n, -1, self.group_size).astype(np.float32)
        w = (groups - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        return w.reshape(n, -1)[:, : self.k]


def quantize_groupwise(w: np.ndarray, bits: int, group_size: int) -> GroupQuantized:
    """Asymmetric round-to-nearest with zero points; each group's range always includes 0."""
    return by_row_slabs(lambda rows: _quantize_groupwise(rows, bits, group_size), np.asarray(w, dtype=np.float32))


def _quantize_groupwise(w: np.ndarray, bits: int, group_size: int) -> GroupQuantized:
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    qmax = (1 << bits) - 1
    n_groups = -(-k // group_size)
    pad = n_groups * group_size - k
    # Pad with zeros: they never widen the range since every range includes 0.
    groups = np.pad(w, ((0, 0), (0, pad))).reshape(n, n_groups, group_size)
    lo = np.minimum(groups.min(axis=-1), 0.0)
    hi = np.maximum(groups.max(axis=-1), 0.0)
    scales = (hi - lo) / qmax
    scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
    zero_points = np.clip(np.round(-lo / scales), 0, qmax).astype(np.uint8)
    q = np.clip(np.round(groups / scales[..., None]) + zero_points[..., None], 0, qmax).astype(np.uint8)
    return GroupQuantized(q.reshape(n, -1), scales, zero_points, bits, group_size, k)


def quantize_per_channel_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel: ``w ≈ q * scale[:, None]``, q in [-127, 127]."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=1) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def per_channel_as_groups(w: np.ndarray, group_size: int) -> GroupQuantized:
    """Per-output-channel symmetric int8, laid out as 8-bit groups that all share the row's scale.

    MatMulNBits only knows group-wise scales; repeating one scale (zero point 128) over every
    group of a row is exactly per-channel quantization in its layout. The group size is only a
    layout choice: the largest of group_size, 64, 32, 16 that divides K (no padding) is used.
    """
    return by_row_slabs(lambda rows: _per_channel_as_groups(rows, group_size), np.asarray(w, dtype=np.float32))


def _per_channel_as_groups(w: np.ndarray, group_size: int) -> GroupQuantized:
    q, scale = quantize_per_channel_int8(w)
    n, k = q.shape
    group_size = next((g for g in (group_size, 64, 32, 16) if g <= group_size and k % g == 0), group_size)
    n_groups = -(-k // group_size)
    pad = n_groups * group_size - k
    q_u8 = (np.pad(q.astype(np.int16), ((0, 0), (0, pad))) + 128).astype(np.uint8)
    scales = np.repeat(scale[:, None], n_groups, axis=1)
    zero_points = np.full((n, n_groups), 128, dtype=np.uint8)
    return GroupQuantized(q_u8, scales, zero_points, 8, group_size, k)


def quantize_q4_1(w: np.ndarray) -> Q4_1Weights:
    """llama.cpp's Q4_1 (blocks of 32 along K, float16 step and minimum); lossless on Q4_1 GGUF weights.

    A Q4_1 block maps its minimum to q = 0 and its maximum to q = 15, so on weights a Q4_1 GGUF
    dequantized the block's min is m exactly and (max - min) / 15 rounds back to d in float16.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.shape[1] % BLOCK:
        raise ValueError(f"Q4_1 blocks of {BLOCK} need K divisible by {BLOCK}, not {w.shape[1]}")
    return by_row_slabs(_quantize_q4_1, w)


def _quantize_q4_1(w: np.ndarray) -> Q4_1Weights:
    n, k = w.shape
    blocks = w.reshape(n, -1, BLOCK)
    lo, hi = blocks.min(axis=-1), blocks.max(axis=-1)
    d, m = ((hi - lo) / np.float32(15)).astype(np.float16), lo.astype(np.float16)
    step = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((blocks - m.astype(np.float32)[..., None]) / step), 0)
    return Q4_1Weights(np.clip(q, 0, 15).astype(np.uint8).reshape(n, k), d, m)


Q8_0_BLOCK_BYTES = 2 + BLOCK  # float16 d, then 32 int8


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q8_0 of w [N, K] as GGUF rows, uint8 [N, K / 32 * 34]: per block of 32, d = max|w| / 127 (stored
    float16) and q = round(w / d) half away from zero, ggml's reference quantizer bit for bit (so gguf-py's too)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 blocks of {BLOCK} need K divisible by {BLOCK}, not {k}")
    out = np.empty((n, k // BLOCK, Q8_0_BLOCK_BYTES), np.uint8)
    step = max(1, SLAB_ELEMENTS // max(k, 1))
    for start in range(0, n, step):
        blocks = w[start:start + step].reshape(-1, k // BLOCK, BLOCK)
        d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore"):
            inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
        scaled = np.abs(blocks * inverse)
        whole = np.floor(scaled)
        q = np.sign(blocks) * (whole + np.floor(2 * (scaled - whole)))  # roundf: halves away from zero
        out[start:start + step, :, :2] = d.astype(np.float16).view(np.uint8)
        out[start:start + step, :, 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(n, -1)
