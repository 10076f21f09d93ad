"""Paged attention over block tables for a packed ragged batch: one kernel for prefill chunks and decode tokens.

Grid (query blocks, KV heads, splits). A program takes BLOCK_Q consecutive query tokens of one sequence and
all GROUP query heads that share KV head g, as one [BLOCK_M = BLOCK_Q * GROUP_PAD, D] tile (row r: token
r // GROUP_PAD, head g * GROUP + r % GROUP_PAD), so each K/V tile read from the pool serves the whole head
group (GQA/MQA) and a decode token's GROUP heads fill the rows a single head could not. Query blocks never
span sequences: sequence s owns the block indices [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1), so
the grid is num_tokens // BLOCK_Q + num_seqs and each program finds its sequence by binary search (the same
trick as vLLM's unified Triton attention), without a host-side schedule.

The program walks the K/V positions its rows can see in tiles of TILE tokens (independent of the pool's
block size: each position's block is looked up in the block table), from the sliding window's start to the
last query's position, with an online softmax in base 2. Positions past a row's own (causal) or before its
window are masked by absolute position, as kiln/paged_attention.py specifies; block-table entries outside
that range are never read.

Split-context (flash-decoding): with NUM_SPLITS > 1 the tiles of each sequence are divided into NUM_SPLITS
contiguous ranges, one per program along grid axis 2, and each writes its unnormalized partial output with its
running max and sum; merge_splits_kernel combines them. It serves small batches of long contexts, where
num_seqs * num_kv_heads programs would leave most SMs idle.

Quantized pools (int8, fp8) are dequantized in registers: q.k is scaled by the K step of head g (one scalar
per program) and the output by the V step, the factoring the spec states.

Parameter order: tensor inputs, int32 scalars, tensor outputs (out, then the split partials), the launch ABI of
a TensorRT AOT plugin (trt_plugin.py), whose extra arguments are int32 only: the softmax scale is the
constexpr SCALE. The single-pass kernel compiled for TensorRT has partial_ptr and stats_ptr specialized to
None (aot.py), so its PTX parameters are exactly the plugin's inputs, scalars and one output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.plugins_trt.triton_common import last_start_at_or_before, load_rotated

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def paged_attention_kernel(
    query_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, kv_scale_ptr, cos_ptr, sin_ptr,
    num_seqs, block_table_stride,
    out_ptr, partial_ptr, stats_ptr,
    SCALE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    HALF_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, POOL_KIND: tl.constexpr, NUM_SPLITS: tl.constexpr,
    INTERPRET: tl.constexpr = False,
):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = last_start_at_or_before(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q, True)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # this block's first token within the sequence
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    q_index = first + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_index < q_len) & (rows % GROUP_PAD < GROUP)
    token = (q_start + q_index).to(tl.int64)
    pos = context_start + q_index
    q_rows = token * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM
    q = load_rotated(query_ptr, q_rows, pos, row_ok, cos_ptr, sin_ptr, HEAD_DIM, HEAD_DIM_PAD, HALF_ROTARY,
                     INTERLEAVED)

    qk_scale = SCALE * LOG2E
    v_step = 1.0
    if POOL_KIND != 0:
        qk_scale = qk_scale * tl.load(kv_scale_ptr + kv_head)
        v_step = tl.load(kv_scale_ptr + NUM_KV_HEADS + kv_head)
    # The dot's operand type: the pool's float type, fp16 for quantized pools (int8 and e4m3 convert exactly).
    if POOL_KIND == 0:
        dot_type = kv_cache_ptr.dtype.element_ty
    else:
        dot_type = tl.float16
    q = q.to(dot_type)

    last_pos = context_start + tl.minimum(first + BLOCK_Q, q_len) - 1
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(context_start + first - SLIDING_WINDOW + 1, 0)
    tile_lo = lo // TILE
    tile_hi = (last_pos + TILE) // TILE
    if NUM_SPLITS > 1:
        per_split = (tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    head_stride = BLOCK_SIZE * HEAD_DIM
    kv_base = kv_cache_ptr + kv_head * head_stride
    v_offset = NUM_KV_HEADS * head_stride
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if INTERPRET:  # the interpreter cannot take a tensor as a range() bound (numpy >= 2 refuses int(array([n])))
        tile = tile_lo
        while tile < tile_hi:
            m, total, acc = _attend_tile(q, m, total, acc, tile, pos, lo, last_pos, qk_scale, table, kv_base,
                                         v_offset, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, NUM_KV_HEADS, TILE,
                                         SLIDING_WINDOW, POOL_KIND)
            tile += 1
    else:
        for tile in range(tile_lo, tile_hi):
            m, total, acc = _attend_tile(q, m, total, acc, tile, pos, lo, last_pos, qk_scale, table, kv_base,
                                         v_offset, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, NUM_KV_HEADS, TILE,
                                         SLIDING_WINDOW, POOL_KIND)

    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        result = acc * (v_step / total)[:, None]
        out_rows = token * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM
        tl.store(out_ptr + out_rows[:, None] + d[None, :], result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial [T, H, NUM_SPLITS, D] and stats [T, H, NUM_SPLITS, 2] (max, sum), float32
        cell = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_ptr + cell[:, None] * HEAD_DIM + d[None, :], acc * v_step, mask=out_mask)
        tl.store(stats_ptr + cell * 2, m, mask=row_ok)
        tl.store(stats_ptr + cell * 2 + 1, total, mask=row_ok)


@triton.jit
def _attend_tile(q, m, total, acc, tile, pos, lo, last_pos, qk_scale, table, kv_base, v_offset,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr, TILE: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                 POOL_KIND: tl.constexpr):
    """One step of the online softmax: K/V positions [tile * TILE, (tile + 1) * TILE) of the program's sequence."""
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    head_stride = BLOCK_SIZE * HEAD_DIM
    dot_type = q.dtype
    kv_pos = tile * TILE + tl.arange(0, TILE)
    kv_ok = (kv_pos >= lo) & (kv_pos <= last_pos)
    block = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    slots = block * (2 * NUM_KV_HEADS * head_stride) + (kv_pos % BLOCK_SIZE) * HEAD_DIM
    kv_mask = kv_ok[:, None] & d_ok[None, :]
    k = tl.load(kv_base + slots[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dot_type)
    v = tl.load(kv_base + v_offset + slots[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dot_type)
    if dot_type == tl.float32:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        scores = tl.dot(q, tl.trans(k)) * qk_scale
    allowed = kv_ok[None, :] & (kv_pos[None, :] <= pos[:, None])
    if SLIDING_WINDOW > 0:
        allowed = allowed & (kv_pos[None, :] > pos[:, None] - SLIDING_WINDOW)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    p = tl.exp2(scores - shift[:, None])
    alpha = tl.exp2(m - shift)
    total = total * alpha + tl.sum(p, axis=1)
    if dot_type == tl.float32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_type), v)
    return m_new, total, acc


@triton.jit
def merge_splits_kernel(
    partial_ptr, stats_ptr, out_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """out[t, h] = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i over the splits i of (token t, head h);
    one program per (token, head): a program's load is NUM_SPLITS x HEAD_DIM, and a single decode token's heads
    merge on as many SMs."""
    cell = tl.program_id(0).to(tl.int64) * NUM_HEADS + tl.program_id(1)
    cells = cell * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(stats_ptr + cells * 2)
    total = tl.load(stats_ptr + cells * 2 + 1)
    peak = tl.max(m, axis=0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    weight = tl.exp2(m - peak)  # an empty split (m = -inf) weighs 0
    d = tl.arange(0, HEAD_DIM_PAD)
    partial = tl.load(partial_ptr + cells[:, None] * HEAD_DIM + d[None, :], mask=(d < HEAD_DIM)[None, :], other=0.0)
    result = tl.sum(partial * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    tl.store(out_ptr + cell * HEAD_DIM + d, result.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
