"""kiln.MatMulGGUF with int8 activations (attribute int8_activations = 1): the executable spec, exact integers.

Activations: each row of x is quantized in blocks of the weight type's granularity, as llama.cpp pairs them
(Q4_0, Q8_0 with 32-value blocks like its Q8_0; the k-quants with 256-value blocks like its Q8_K):

    step = max|x_block| / 127 (0 for an all-zero block),  xq = rint(x * (1 / step)) (half to even), in float32

and the sums their terms need: for Q6_K the integer sums of each 16 consecutive xq (Q8_K's bsums); for Q4_K and
Q5_K per sub-block of 32 the float sum S of x and what int8 loses of it, E = S - step * sum(xq).

Each (row, output channel, block) is then one exact integer dot and at most two float32 scale products:

    Q4_0, Q8_0   isum = sum_i w_i xq_i                     (w = q - 8, or the int8 q)
                 term = (step * d) * isum
    Q4_K, Q5_K   isum = sum_j sc_j (q_j . xq_j)            (8 sub-blocks of 32, q the 4- or 5-bit code)
                 term = (step * d) * isum + sum_j (c * (d * sc_j)) * E_j - sum_j (dmin * m_j) * S_j
    Q6_K         isum = sum_g sc_g ((q_g - 32) . xq_g)     (16 groups of 16, sc_g the int8 scale)
                 term = (step * d) * isum

    y = sum over blocks of term (+ bias)

with c the codes' mean (Q4_K 7.5, Q5_K 15.5). Since x = step * xq + (rounding), q_j . x_j = step (q_j . xq_j) +
c E_j + ((q_j - c) . rounding): the minimums meet the exact float sums and the codes' mean meets what int8 lost of
them, so int8 rounding reaches only the centred codes q - c (llama.cpp's q8_K takes the minimums from the integer
sums and multiplies the raw codes; kiln.MatMulQ4_1 takes the exact sums for Q4_1, where they measured 1% of
perplexity on SmolLM2). Q4_0, Q6_K and Q8_0
codes are centred already (q - 8, q - 32, signed), and Q6_K's offset is exact in integers.

(step * d), (step * dmin), (d * sc_j), (dmin * m_j) and c * (d * sc_j) are float32 products, the kernel's numbers;
the integers are exact in the kernel too (int16 pair sums of at most 2 * 63 * 127, int32 block sums). The kernel
sums in float32 (S of 32 values, the terms in 8 lanes, then the lanes), this spec in float64: the two agree within
float32 summation-order bounds, not bit for bit, and `block_terms` gives each term's magnitude a test bounds that
by. The float32-activation path (int8_activations = 0, kiln/matmul_gguf.py) keeps x exact, a reference within
float32 rounding of the file's dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.gguf_blocks import FORMATS, GgmlType, block_integers, ggml_type, row_weights

INT8_MAX = 127
SUM_GROUP = 16  # activations per integer sum (Q8_K's bsums)
CENTRES = {GgmlType.Q4_K: 7.5, GgmlType.Q5_K: 15.5}  # the codes' mean, taken from the exact sums
# the weight types this path multiplies (Q5_0 / Q5_1 have no int8 kernel: their nodes keep float32 activations)
INT8_KINDS = frozenset({GgmlType.Q4_0, GgmlType.Q8_0, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K})


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
        x64 = np.asarray(x, np.float64).reshape(t, nb, 8, 32)
        sums, abs_sums = x64.sum(-1), np.abs(x64).sum(-1)  # S_j, and what bounds its float32 rounding
        int8_part = acts.step.astype(np.float64)[..., None] * xq.reshape(t, nb, 8, 32).sum(-1)
        errors = sums - int8_part  # E_j
        centre = CENTRES[kind]
        scale_j = (ints.d[..., None] * ints.scales).astype(np.float32)  # d * sc_j, [N, nb, 8]
        centred = (scale_j * np.float32(centre)).astype(np.float64)
        minimum = (ints.dmin[..., None] * ints.mins).astype(np.float32).astype(np.float64)
        terms = terms + np.einsum("nbj,tbj->tnb", centred, errors) - np.einsum("nbj,tbj->tnb", minimum, sums)
        magnitudes = (magnitudes + np.einsum("nbj,tbj->tnb", np.abs(centred), abs_sums + np.abs(int8_part))
                      + np.einsum("nbj,tbj->tnb", np.abs(minimum), abs_sums))
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
    out: np.ndarray = y.astype(np.float32).reshape(*x.shape[:-1], w.shape[0])
    return out
