"""Device helpers the kiln Triton kernels share: finding a token's sequence, RoPE on load, KV (de)quantization.

Everything here is `@triton.jit` and inlined into the kernels (kv_write.py, attention.py); the semantics are
those of kiln/paged_attention.py, the op's executable spec.
"""

from __future__ import annotations

import triton
import triton.language as tl

# How the pool stores K/V (a constexpr of every kernel): plain floats, or per-head quantized with a step.
POOL_FLOAT = 0  # float32 / float16 / bfloat16: values rounded to the pool's dtype
POOL_INT8 = 1  # clamp(round_half_even(x / step), -127, 127)
POOL_FP8 = 2  # float8 e4m3fn of clamp(x / step, -448, 448), round to nearest even
INT8_MAX = 127  # the kernels spell these bounds as literals (the interpreter drops constexpr globals)
FP8_E4M3_MAX = 448.0


@triton.jit
def last_start_at_or_before(starts_ptr, target, count, BLOCK_Q: tl.constexpr, PER_BLOCK: tl.constexpr):
    """The largest s in [0, count) with start(s) <= target, where start(s) = starts[s] when not PER_BLOCK,
    else starts[s] // BLOCK_Q + s (the first query block of sequence s; query blocks never span sequences)."""
    lo = 0
    hi = count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(starts_ptr + mid)
        if PER_BLOCK:
            start = start // BLOCK_Q + mid
        if start <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def load_rotated(base_ptr, row_offsets, positions, row_mask, cos_ptr, sin_ptr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HALF_ROTARY: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    """float32 [rows, HEAD_DIM_PAD] loaded from base_ptr + row_offsets[r] + d, rotated by RoPE at positions[r]
    (HALF_ROTARY = R/2 pairs; 0 = no RoPE). Pairs (d, d + R/2) (rotate_half) or (2j, 2j + 1) (INTERLEAVED) map
    (a, b) -> (a c - b s, b c + a s); dims >= R pass through; padded dims are 0."""
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    mask = row_mask[:, None] & d_ok[None, :]
    x = tl.load(base_ptr + row_offsets[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HALF_ROTARY > 0:
        rotated = d < 2 * HALF_ROTARY
        if INTERLEAVED:
            partner = d ^ 1
            freq = d // 2
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        else:
            first = d < HALF_ROTARY
            partner = tl.where(first, d + HALF_ROTARY, d - HALF_ROTARY)
            freq = tl.where(first, d, d - HALF_ROTARY)
            sign = tl.where(first, -1.0, 1.0)
        partner = tl.where(rotated, partner, d)
        freq = tl.where(rotated, freq, 0)
        rot_mask = row_mask[:, None] & rotated[None, :]
        other = tl.load(base_ptr + row_offsets[:, None] + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
        table = positions[:, None] * HALF_ROTARY + freq[None, :]
        c = tl.load(cos_ptr + table, mask=rot_mask, other=1.0)
        s = tl.load(sin_ptr + table, mask=rot_mask, other=0.0)
        x = tl.where(rotated[None, :], x * c + sign[None, :] * other * s, x)
    return x


@triton.jit
def quantize(x, step, POOL_KIND: tl.constexpr):
    """x [float32 tile] as the pool stores it (the caller's store casts to the pool's element type)."""
    if POOL_KIND == 1:
        # clamp, then round half to even (numpy's rint, the C++ kernel's nearbyint) by the float32 magic number
        # 1.5 * 2^23: |y| <= 127 leaves no bits below the unit in y + 12582912, so the add rounds y exactly once
        y = tl.minimum(tl.maximum(x / step, -127.0), 127.0)
        return ((y + 12582912.0) - 12582912.0).to(tl.int8)
    elif POOL_KIND == 2:
        return tl.minimum(tl.maximum(x / step, -448.0), 448.0).to(tl.float8e4nv)
    else:
        return x
