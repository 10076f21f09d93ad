"""KV write (reshape_and_cache): the new tokens' K (after RoPE) and V into their slots of the paged pool.

One program per token of the packed batch stores all KV heads of that token: block
block_tables[s][pos // block_size], slot pos % block_size, as kiln/paged_attention.py specifies (rounded to the
pool's dtype; int8 and fp8 pools quantized with the per-head steps kv_scale[0|1][g]). Nothing else of the pool
is touched, so the pool is updated in place; a token whose position or block is out of range writes nothing
(the host-side checks in launcher.py refuse such inputs before a launch).

Parameter order: tensor inputs, int32 scalars, tensor outputs, the launch ABI of a TensorRT AOT plugin
(trt_plugin.py). The pool comes twice: kv_cache_ptr among the inputs and kv_cache_out_ptr as the output, one
buffer (TensorRT aliases the plugin's output to its input; the torch launcher passes the pool twice); the
kernel writes through the output and never reads the input.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.plugins_trt.triton_common import last_start_at_or_before, load_rotated, quantize


@triton.jit
def kv_write_kernel(
    key_ptr, value_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, kv_scale_ptr,
    cos_ptr, sin_ptr,
    num_seqs, num_blocks, block_table_stride,
    kv_cache_out_ptr,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HALF_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, POOL_KIND: tl.constexpr,
):
    token = tl.program_id(0)
    seq = last_start_at_or_before(query_start_loc_ptr, token, num_seqs, 1, False)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    pos = tl.load(seq_lens_ptr + seq) - (q_end - q_start) + (token - q_start)
    block = tl.load(block_tables_ptr + seq * block_table_stride + pos // BLOCK_SIZE, mask=pos >= 0, other=-1)
    valid = (pos >= 0) & (block >= 0) & (block < num_blocks)
    heads = tl.arange(0, KV_HEADS_PAD)
    head_ok = (heads < NUM_KV_HEADS) & valid
    rows = token.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM
    positions = tl.full([KV_HEADS_PAD], 0, tl.int32) + pos
    k = load_rotated(key_ptr, rows, positions, head_ok, cos_ptr, sin_ptr, HEAD_DIM, HEAD_DIM_PAD, HALF_ROTARY,
                     INTERLEAVED)
    v = load_rotated(value_ptr, rows, positions, head_ok, cos_ptr, sin_ptr, HEAD_DIM, HEAD_DIM_PAD, 0, INTERLEAVED)
    k_step = tl.full([KV_HEADS_PAD], 1.0, tl.float32)
    v_step = k_step
    if POOL_KIND != 0:
        k_step = tl.load(kv_scale_ptr + heads, mask=head_ok, other=1.0)
        v_step = tl.load(kv_scale_ptr + NUM_KV_HEADS + heads, mask=head_ok, other=1.0)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = head_ok[:, None] & (d < HEAD_DIM)[None, :]
    head_stride = BLOCK_SIZE * HEAD_DIM
    k_slots = (block.to(tl.int64) * (2 * NUM_KV_HEADS * head_stride) + heads * head_stride
               + (pos % BLOCK_SIZE) * HEAD_DIM)
    dst = kv_cache_out_ptr + k_slots[:, None] + d[None, :]
    element = kv_cache_out_ptr.dtype.element_ty
    tl.store(dst, quantize(k, k_step[:, None], POOL_KIND).to(element), mask=mask)
    tl.store(dst + NUM_KV_HEADS * head_stride, quantize(v, v_step[:, None], POOL_KIND).to(element), mask=mask)
