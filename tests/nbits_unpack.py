"""Dequantize MatMulNBits initializers back to a weight matrix (the inverse of kiln's packing).

Test-only, so it lives here and not in the shipped optimize/quant/nbits.py; the layout is the
one that module's docstring gives (ORT's contrib-op spec).
"""

from __future__ import annotations

import numpy as np


def unpack(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, bits: int, k: int) -> np.ndarray:
    """Dequantize MatMulNBits initializers back to ``w [N, K]``."""
    n, n_blocks, blob = b.shape
    if bits == 4:
        q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, n_blocks, blob * 2)
        zp = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(n, -1)[:, :n_blocks]
    else:
        q, zp = b, zero_points.reshape(n, n_blocks)
    s = scales.reshape(n, n_blocks)
    w = (q.astype(np.float32) - zp[..., None].astype(np.float32)) * s[..., None]
    return w.reshape(n, -1)[:, :k]
