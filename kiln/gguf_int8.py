"""kiln.MatMulGGUF with int8 activations (attribute int8_activations = 1): the executable spec, exact integers.

Activations: each row of x is quantized in blocks of the weight type's granularity, as llama.cpp pairs them
(Q4_0, Q8_0 with 32-value blocks like its Q8_0; the k-quants with 256-value blocks like its Q8_K):

    step = max|x_block| / 127 (0 for an all-zero block),  xq = rint(x * (1 / step)) (half to even), in float32

and, for the k-quants, the integer sums S of each 16 consecutive xq (Q8_K's bsums).

Each (row, output channel, block) is then one exact integer dot and at most two float32 scale products:

    Q4_0, Q8_0   isum = sum_i w_i xq_i                     (w = q - 8, or the int8 q)
                 term = (step * d) * isum
    Q4_K, Q5_K   isum = sum_j sc_j (q_j . xq_j)            (8 sub-blocks of 32, q the 4- or 5-bit code)
                 imin = sum_j m_j (S_2j + S_2j+1)
                 term = (step * d) * isum - (step * dmin) * imin
    Q6_K         isum = sum_g sc_g ((q_g - 32) . xq_g)     (16 groups of 16, sc_g the int8 scale)
                 term = (step * d) * isum

    y = sum over blocks of term (+ bias)

(step * d) and (step * dmin) are float32 products, the kernel's numbers; the integers are exact in the kernel too
(int16 pair sums of at most 2 * 63 * 127, int32 block sums). The kernel sums the terms in float32 (8 lanes, then
the lanes), this spec in float64: the two agree within float32 summation-order bounds, not bit for bit, and
`block_terms` gives the terms a test bounds that by.

The minimum's and Q6_K's offset use the integer sums (as llama.cpp does), so int8 rounding reaches them too; the
float32-activation path (int8_activations = 0, kiln/matmul_gguf.py) keeps x exact for a reference within float32
rounding of the file's dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.gguf_blocks import FORMATS, GgmlType, block_integers, ggml_type, row_weights

INT8_MAX = 127
SUM_GROUP = 16  # activations per integer sum (Q8_K's bsums)


def activation_block(kind: GgmlType) -> int:
    """Values per activation step: the weight block's 32 (Q4_0, Q8_0) or 256 (the k-quants)."""
    return FORMATS[kind].weights


@dataclass(frozen=True)
class Int8Rows:
    q: np.ndarray  # int8 [T, K]
    step: np.ndarray  # float32 [T, K / block]
    sums: np.ndarray  # int64 [T, K / 16]: sums of 16 consecutive q


def quantize_rows(x: np.ndarray, block: int) -> Int8Rows:
    """x float32 [T, K] (K a multiple of block) -> its int8 blocks, in the kernel's float32 arithmetic."""
    x = np.asarray(x, dtype=np.float32)
    t, k = x.shape
    blocks = x.reshape(t, k // block, block)
    step = (np.abs(blocks).max(axis=-1) / np.float32(INT8_MAX)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(step > 0, np.float32(1) / step, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8).reshape(t, k)
    sums = q.reshape(t, -1, SUM_GROUP).sum(axis=-1, dtype=np.int64)
    return Int8Rows(q, step, sums)


def block_terms(x: np.ndarray, w: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """(terms, magnitudes), float64 [T, N, K / QK]: each block's term (see the module docstring), and the same sum
    over the absolute values of its integer products: what bounds float32's rounding of any partial sum of the
    term (the kernel's lanes hold partial sums that may cancel), x float32 [T, K]."""
    kind = ggml_type(kind)
    k = row_weights(kind, w.shape[1])
    acts = quantize_rows(np.asarray(x, np.float32).reshape(-1, k), activation_block(kind))
    ints = block_integers(w, kind)  # q [N, nb, S, L], scales [N, nb, S], mins [N, nb, 8] or None
    n, nb, subs, length = ints.q.shape
    t = acts.q.shape[0]
    xq = acts.q.astype(np.int64).reshape(t, nb, subs, length)
    q, scales = ints.q.astype(np.int64), ints.scales.astype(np.int64)[None]
    isum = (np.einsum("tbsl,nbsl->tnbs", xq, q) * scales).sum(-1)
    iabs = (np.einsum("tbsl,nbsl->tnbs", np.abs(xq), np.abs(q)) * np.abs(scales)).sum(-1)
    step = acts.step[:, None, :]  # [T, 1, nb]
    scale = (step * ints.d[None]).astype(np.float32).astype(np.float64)
    terms, magnitudes = scale * isum, np.abs(scale) * iabs
    if ints.mins is not None:
        assert ints.dmin is not None
        sub_sums = acts.sums.reshape(t, nb, 8, 2).sum(-1)  # per sub-block of 32
        imin = np.einsum("tbj,nbj->tnb", sub_sums, ints.mins.astype(np.int64))
        imin_abs = np.einsum("tbj,nbj->tnb", np.abs(acts.q.astype(np.int64)).reshape(t, nb, 8, 32).sum(-1),
                             ints.mins.astype(np.int64))
        minimum = (step * ints.dmin[None]).astype(np.float32).astype(np.float64)
        terms, magnitudes = terms - minimum * imin, magnitudes + np.abs(minimum) * imin_abs
    return terms, magnitudes


def matmul_gguf_int8_ref(x: np.ndarray, w: np.ndarray, kind: int, bias: np.ndarray | None = None) -> np.ndarray:
    """y of the int8-activation path, float64 sums; float32 [..., N]."""
    kind = ggml_type(kind)
    if w.ndim != 2 or w.dtype != np.uint8:
        raise ValueError(f"w must be uint8 [N, row bytes], got {w.dtype} {list(w.shape)}")
    k = row_weights(kind, w.shape[1])
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension {x.shape[-1]} is not the weight's K = {k}")
    y = block_terms(x.reshape(-1, k), w, kind)[0].sum(-1)
    if bias is not None:
        y = y + bias.astype(np.float64)
    return y.astype(np.float32).reshape(*x.shape[:-1], w.shape[0])
