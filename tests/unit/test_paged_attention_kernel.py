"""kiln.PagedAttention: the numpy reference against dense attention, and the ONNX Runtime CPU
kernel (libkiln_ops.so) against the reference: ragged batches, GQA, fp16 and int8 KV (per-head
scales), sliding window, RoPE inside the op (cos/sin caches), in-place KV writes through IOBinding, and
clear errors on bad inputs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest

from kiln.paged_attention import (
    INPUT_NAMES,
    KV_SCALE,
    QK_NORM_INPUTS,
    ROTARY_INPUTS,
    PagedAttentionAttrs,
    PagedAttentionInputs,
    QkvLayout,
    apply_rotary,
    make_single_op_model,
    paged_attention_ref,
    token_positions,
)

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

ops = pytest.importorskip("kiln.runtime.ops")
LIBRARY = op_library_or_skip()


@dataclass(frozen=True)
class OpCase:
    """One single-op model: the op's attributes, the head size, the pool's block size and dtype, and
    whether the op applies RoPE (cos/sin inputs of rotary_positions rows)."""

    attrs: PagedAttentionAttrs
    head_dim: int
    block_size: int
    kv_dtype: str = "float32"
    rotary_positions: int = 0  # 0: no cos/sin inputs (Q/K arrive rotated)


def op_case(num_heads, num_kv_heads, head_dim, block_size, kv_dtype="float32", window=0):
    attrs = PagedAttentionAttrs(num_heads, num_kv_heads, sliding_window=window)
    return OpCase(attrs, head_dim, block_size, kv_dtype)


@cache
def session(op, symbolic=False):
    model = make_single_op_model(op.attrs, op.head_dim, op.block_size, np.dtype(op.kv_dtype), op.rotary_positions > 0)
    if symbolic:
        make_symbolic(model)
    return model_session(model)


def model_session(model):
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def make_symbolic(model):
    """Every graph input dim symbolic: lets shapes through to the kernel's own validation."""
    for i, value_info in enumerate(model.graph.input):
        for j, dim in enumerate(value_info.type.tensor_type.shape.dim):
            dim.dim_param = f"d{i}_{j}"


def make_case(rng, seqs, op, spare_blocks=5):
    """Feeds for sequences given as (cached tokens, new tokens); blocks scattered in a larger pool."""
    num_heads, num_kv_heads = op.attrs.num_heads, op.attrs.num_kv_heads
    head_dim, block_size, kv_dtype = op.head_dim, op.block_size, op.kv_dtype
    blocks = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks) + spare_blocks
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(seqs), max(blocks + [0]) + 1), -1, np.int32)  # padding column of -1
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[start : start + n]
        start += n
    new = [n for _, n in seqs]
    T = sum(new)
    pool_shape = (num_blocks, 2, num_kv_heads, block_size, head_dim)
    if kv_dtype == "int8":  # random int8 history; steps around 3 sigma / 127 (so some new K/V clamp)
        pool = rng.integers(-127, 128, pool_shape).astype(np.int8)
    else:
        pool = rng.standard_normal(pool_shape, dtype=np.float32).astype(kv_dtype)
    feeds = {
        "query": rng.standard_normal((T, num_heads * head_dim), dtype=np.float32),
        "key": rng.standard_normal((T, num_kv_heads * head_dim), dtype=np.float32),
        "value": rng.standard_normal((T, num_kv_heads * head_dim), dtype=np.float32),
        "kv_cache": pool,
        "block_tables": tables,
        "seq_lens": np.array([c + n for c, n in seqs], np.int32),
        "query_start_loc": np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
    }
    if kv_dtype == "int8":
        feeds[KV_SCALE] = rng.uniform(2.0, 4.0, (2, num_kv_heads)).astype(np.float32) / 127
    if op.rotary_positions:
        feeds.update(zip(ROTARY_INPUTS, rotary_tables(op.rotary_positions, head_dim), strict=True))
    return feeds


def rotary_tables(positions: int, rotary_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [positions, rotary_dim/2] of Llama's RoPE frequencies (what kiln's build computes)."""
    inv_freq = theta ** -(np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def reference(feeds, op):
    return paged_attention_ref(PagedAttentionInputs(**feeds), op.attrs)


def check(out, pool, ref_out, ref_pool):
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=3e-5)
    assert np.array_equal(pool, ref_pool), "the pool differs: a new slot is wrong or another slot was touched"


# ------------------------------------------------------------------ the reference itself


def dense_attention(q, k, v, positions, window):
    """Naive causal attention of one sequence: q [n, H, D] at `positions`, k/v [L, Hkv, D]."""
    n, H, D = q.shape
    group = H // k.shape[1]
    out = np.zeros((n, H, D))
    for i in range(n):
        for h in range(H):
            keys = [p for p in range(positions[i] + 1) if window == 0 or p > positions[i] - window]
            s = np.array([q[i, h] @ k[p, h // group] for p in keys]) / np.sqrt(D)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[keys, h // group]
    return out


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_reference_matches_dense_attention(group, window, kv_dtype):
    rng = np.random.default_rng(1)
    Hkv, D, bs = 2, 8, 4
    H = Hkv * group
    seqs = [(0, 6), (9, 1), (5, 4)]
    op = op_case(H, Hkv, D, bs, kv_dtype, window)
    feeds = make_case(rng, seqs, op)
    out, pool = reference(feeds, op)
    for s, (cached, new) in enumerate(seqs):
        t0 = feeds["query_start_loc"][s]
        L = cached + new
        k = np.zeros((L, Hkv, D))
        v = np.zeros((L, Hkv, D))
        for p in range(L):  # history: cached tokens from the input pool, new ones from key/value
            blk, slot = feeds["block_tables"][s, p // bs], p % bs
            if p < cached:
                k[p], v[p] = feeds["kv_cache"][blk, 0, :, slot], feeds["kv_cache"][blk, 1, :, slot]
            else:
                row = t0 + p - cached
                k[p] = feeds["key"][row].reshape(Hkv, D).astype(kv_dtype)
                v[p] = feeds["value"][row].reshape(Hkv, D).astype(kv_dtype)
                assert np.array_equal(pool[blk, 0, :, slot], k[p]) and np.array_equal(pool[blk, 1, :, slot], v[p])
        q = feeds["query"][t0 : t0 + new].reshape(new, H, D)
        expected = dense_attention(q, k, v, list(range(cached, L)), window)
        np.testing.assert_allclose(out[t0 : t0 + new].reshape(new, H, D), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group", [1, 3])
def test_reference_int8_close_to_dense_fp32(group):
    """int8 KV with absmax/127 steps: a prefill, then decode steps reading the quantized history,
    stay within quantization error of fp32 attention (and the int8 pool dequantizes to within
    half a step of the fp32 one)."""
    rng = np.random.default_rng(11)
    Hkv, D, bs = 2, 64, 16
    H = Hkv * group
    seqs = [(0, 40), (0, 7), (0, 1)]
    op = op_case(H, Hkv, D, bs)
    f32 = make_case(rng, seqs, op)
    f32["kv_cache"][:] = 0
    f32["key"] *= np.repeat(rng.uniform(0.5, 3.0, Hkv), D).astype(np.float32)  # heads of different ranges
    steps = np.stack([np.abs(f32[n]).reshape(-1, Hkv, D).max(axis=(0, 2)) / 127 for n in ("key", "value")])
    i8 = {**f32, "kv_cache": np.zeros(f32["kv_cache"].shape, np.int8), KV_SCALE: steps.astype(np.float32)}
    pool32, pool8 = f32["kv_cache"], i8["kv_cache"]
    for step in range(3):
        out32, pool32 = reference({**f32, "kv_cache": pool32}, op)
        out8, pool8 = reference({**i8, "kv_cache": pool8}, op)
        deq = pool8.astype(np.float32) * np.stack([steps[0], steps[1]])[None, :, :, None, None]
        assert np.abs(deq - pool32).max() <= 0.5 * steps.max() * (1 + 1e-5)
        err = np.abs(out8 - out32)
        # |K| up to ~10 (steps ~0.08): about 1% mean error, the size of int8 rounding; a wrong step is far off
        assert err.max() < 0.1 and err.mean() < 0.02 * np.abs(out32).mean(), (step, err.max(), err.mean())
        # next: one decode token per sequence, within the calibrated range
        T = len(seqs)
        new = make_case(rng, [(0, 1)] * T, op)
        for n in ("key", "value"):
            bound = 127 * steps[int(n == "value")].min()
            new[n] = np.clip(new[n], -bound, bound)
        f32 = {**f32, **{n: new[n] for n in ("query", "key", "value")},
               "seq_lens": f32["seq_lens"] + 1, "query_start_loc": np.arange(T + 1, dtype=np.int32)}
        i8 = {**i8, **{n: f32[n] for n in ("query", "key", "value", "seq_lens", "query_start_loc")}}


def test_reference_int8_needs_kv_scale():
    feeds = make_case(np.random.default_rng(12), [(0, 3)], op_case(4, 2, 16, 16, "int8"))
    with pytest.raises(ValueError, match="kv_scale"):
        PagedAttentionInputs(**{n: feeds[n] for n in INPUT_NAMES})
    with pytest.raises(ValueError, match="kv_scale"):
        PagedAttentionInputs(**{**feeds, KV_SCALE: feeds[KV_SCALE][:, :1]})
    float_feeds = make_case(np.random.default_rng(12), [(0, 3)], op_case(4, 2, 16, 16))
    with pytest.raises(ValueError, match="kv_scale"):
        PagedAttentionInputs(**float_feeds, kv_scale=feeds[KV_SCALE])


# ------------------------------------------------------------------ the kernel vs the reference

MIXED = [(0, 37), (100, 1), (16, 16), (0, 1), (250, 23), (31, 1), (7, 0)]  # prefill, chunks, decode, idle


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (16, 2)], ids=["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_kernel_mixed_batch(block_size, heads, kv_dtype):
    H, Hkv = heads
    rng = np.random.default_rng(block_size + H)
    op = op_case(H, Hkv, 64, block_size, kv_dtype)
    feeds = make_case(rng, MIXED, op)
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


@pytest.mark.parametrize(
    "seqs",
    [[(4095, 1)], [(4000, 96)], [(2047, 1), (1024, 1), (3000, 1), (511, 1)], [(0, 300)]],
    ids=["decode-4096", "chunk-at-4000", "decode-batch", "prefill-300"],
)
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_kernel_long_contexts(seqs, kv_dtype):
    rng = np.random.default_rng(7)
    op = op_case(9, 3, 64, 16, kv_dtype)
    feeds = make_case(rng, seqs, op, spare_blocks=40)
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


@pytest.mark.parametrize("seqs", [[(99, 1)], [(40, 1), (8, 3)]], ids=["decode-100", "two-short"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_kernel_small_batch(seqs, kv_dtype):
    """Work below the kernel's serial threshold: every item unpartitioned, on the calling thread."""
    rng = np.random.default_rng(11)
    op = op_case(9, 3, 64, 16, kv_dtype)
    feeds = make_case(rng, seqs, op)
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


@pytest.mark.parametrize("window", [1, 20, 100])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_kernel_sliding_window(window, kv_dtype):
    rng = np.random.default_rng(window)
    op = op_case(8, 2, 32, 16, kv_dtype, window)
    feeds = make_case(rng, [(0, 45), (300, 1), (130, 30)], op)
    # Blocks wholly outside every token's window may be freed: the kernel must not read them.
    feeds["block_tables"][1, : (300 - window + 1) // 16] = -1
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


@pytest.mark.parametrize("head_dim", [12, 20, 128])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_kernel_head_dims(head_dim, kv_dtype):
    rng = np.random.default_rng(head_dim)
    op = op_case(6, 2, head_dim, 16, kv_dtype)
    feeds = make_case(rng, [(0, 9), (40, 1), (17, 5)], op)
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


@pytest.mark.parametrize("head_dim", [20, 64])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_kernel_group_of_four(head_dim, kv_dtype):
    """4 query heads per KV head (Llama 3's 32/8): the 4-row block of the inner loops that converts each fp16/int8
    K and V vector once for all four, with head_dim tails and slices of odd length (decode past a block edge,
    chunks starting mid-block); a long decode split across partitions."""
    rng = np.random.default_rng(head_dim + 4)
    op = op_case(8, 2, head_dim, 16, kv_dtype)
    feeds = make_case(rng, [(0, 21), (40, 1), (17, 5), (2500, 1), (33, 0)], op, spare_blocks=20)
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_kernel_group_of_four_tiles(kv_dtype):
    """Blocks that every row sees whole are attended 4 at a time (one softmax update, interleaved scores): decodes
    ending on a tile edge, one position past it, a whole block past it, and partial blocks of odd and even length
    after 1 or 2 tiles; a chunk whose first tile is whole and whose later blocks are masked per token (the per-block
    path after a flushed tile)."""
    rng = np.random.default_rng(44)
    op = op_case(8, 2, 64, 16, kv_dtype)
    feeds = make_case(rng, [(63, 1), (64, 1), (79, 1), (100, 1), (150, 1), (70, 30)], op)
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_long_decode_is_the_same_on_any_thread_count(kv_dtype):
    """A long decode is split across context partitions planned from the machine, not the session's threads: one
    and two intra-op threads give bitwise the same output (and the reference's)."""
    op = op_case(32, 8, 64, 16, kv_dtype)
    feeds = make_case(np.random.default_rng(5), [(8191, 1)], op)
    model = make_single_op_model(op.attrs, op.head_dim, op.block_size, np.dtype(op.kv_dtype))
    outs = []
    for threads in (1, 2):
        so = ort.SessionOptions()
        so.register_custom_ops_library(LIBRARY)
        so.intra_op_num_threads = threads
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        outs.append(sess.run(None, feeds))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    check(*outs[0], *reference(feeds, op))


@pytest.mark.parametrize("seqs", [[], [(5, 0), (0, 0)]], ids=["no-sequences", "no-new-tokens"])
def test_kernel_empty_batch(seqs):
    op = op_case(4, 2, 16, 16)
    feeds = make_case(np.random.default_rng(8), seqs, op)
    out, pool = session(op).run(None, feeds)
    assert out.shape == (0, 64)
    check(out, pool, *reference(feeds, op))


# ------------------------------------------------------------------ in place through IOBinding


def run_in_place(sess, feeds):
    """One OrtValue over feeds['kv_cache'] bound as kv_cache and kv_cache_out; returns `out`."""
    pool_value = ort.OrtValue.ortvalue_from_numpy(feeds["kv_cache"])
    assert pool_value.data_ptr() == feeds["kv_cache"].ctypes.data
    binding = sess.io_binding()
    for name in INPUT_NAMES + ((KV_SCALE,) if KV_SCALE in feeds else ()):
        if name != "kv_cache":
            binding.bind_cpu_input(name, feeds[name])
    binding.bind_ortvalue_input("kv_cache", pool_value)
    binding.bind_output("out", "cpu")
    binding.bind_ortvalue_output("kv_cache_out", pool_value)
    sess.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_in_place_prefill_then_decode_steps(kv_dtype):
    rng = np.random.default_rng(3)
    H, Hkv, D, bs = 9, 3, 64, 16
    op = op_case(H, Hkv, D, bs, kv_dtype)
    sess = session(op)
    feeds = make_case(rng, [(0, 40), (0, 16), (0, 17)], op, spare_blocks=50)
    feeds["block_tables"] = np.concatenate([feeds["block_tables"], np.full((3, 2), -1, np.int32)], axis=1)
    free = sorted(set(range(len(feeds["kv_cache"]))) - set(feeds["block_tables"].ravel().tolist()))
    pool = feeds["kv_cache"]  # the one buffer every step writes into
    expected_pool = pool.copy()
    for _ in range(4):
        expected_out, expected_pool = reference({**feeds, "kv_cache": expected_pool}, op)
        out = run_in_place(sess, feeds)
        check(out, pool, expected_out, expected_pool)
        # next step: one decode token per sequence, a new block when one fills up
        lens = feeds["seq_lens"] + 1
        for s, L in enumerate(lens):
            if (L - 1) % bs == 0:
                feeds["block_tables"][s, (L - 1) // bs] = free.pop()
        feeds = {
            **make_case(rng, [(0, 1)] * 3, op),
            **({KV_SCALE: feeds[KV_SCALE]} if KV_SCALE in feeds else {}),
            "kv_cache": pool,
            "block_tables": feeds["block_tables"],
            "seq_lens": lens.astype(np.int32),
            "query_start_loc": np.arange(4, dtype=np.int32),
        }


def test_in_place_touches_only_new_slots():
    rng = np.random.default_rng(4)
    op = op_case(4, 2, 16, 16)
    feeds = make_case(rng, [(33, 2), (0, 5)], op, spare_blocks=200)
    before = feeds["kv_cache"].copy()
    run_in_place(session(op), feeds)
    changed = np.argwhere((feeds["kv_cache"] != before).any(axis=(1, 2, 4)))  # (block, slot) pairs
    expected = {(feeds["block_tables"][0, p // 16], p % 16) for p in (33, 34)}
    expected |= {(feeds["block_tables"][1, 0], p) for p in range(5)}
    assert {tuple(x) for x in changed.tolist()} == {(int(b), int(s)) for b, s in expected}


# ------------------------------------------------------------------ errors


def corrupt(feeds, what):
    f = {k: v.copy() for k, v in feeds.items()}
    if what == "qsl-decreasing":
        f["query_start_loc"][1:3] = f["query_start_loc"][2:0:-1]
    elif what == "qsl-total":
        f["query_start_loc"][-1] -= 1
    elif what == "qsl-start":
        f["query_start_loc"][0] = 1
    elif what == "seq-shorter-than-new":
        f["seq_lens"][0] = 1
    elif what == "seq-beyond-table":
        f["seq_lens"][1] = f["block_tables"].shape[1] * 16 + 1
    elif what == "block-out-of-pool":
        f["block_tables"][1, 0] = len(f["kv_cache"])
    elif what == "block-negative":
        f["block_tables"][0, 0] = -1
    elif what == "key-width":
        f["key"] = f["key"][:, :-16]
    elif what == "pool-heads":
        f["kv_cache"] = f["kv_cache"][:, :, :1]
    elif what == "seq-lens-count":
        f["seq_lens"] = f["seq_lens"][:1]
    return f


ERRORS = {
    "qsl-decreasing": "query_start_loc must be non-decreasing",
    "qsl-total": r"query_start_loc\[-1\] \(\d+\) must equal num_tokens",
    "qsl-start": r"query_start_loc\[0\] must be 0",
    "seq-shorter-than-new": "smaller than its number of new tokens",
    "seq-beyond-table": "needs more blocks than block_tables has columns",
    "block-out-of-pool": "is outside the pool",
    "block-negative": "is outside the pool",
    "key-width": "key must be",
    "pool-heads": "kv_cache must be",
    "seq-lens-count": "seq_lens must be",
}


@pytest.mark.parametrize("what", sorted(ERRORS))
def test_bad_inputs_raise_clear_errors(what):
    rng = np.random.default_rng(5)
    op = op_case(4, 2, 16, 16)
    feeds = make_case(rng, [(3, 4), (20, 1), (0, 2)], op)
    with pytest.raises(Exception, match="kiln.PagedAttention: .*" + ERRORS[what]):
        session(op, symbolic=True).run(None, corrupt(feeds, what))


def _retype(model, drop_kv_scale=False, add_kv_scale=False):
    """The single-op model without (int8) or with (float) the kv_scale input."""
    from onnx import TensorProto, helper

    node = model.graph.node[0]
    if drop_kv_scale:
        del node.input[-1]
        del model.graph.input[-1]
    if add_kv_scale:
        node.input.append(KV_SCALE)
        model.graph.input.append(helper.make_tensor_value_info(KV_SCALE, TensorProto.FLOAT, ["two", "hkv"]))
    return model


KV_SCALE_ERRORS = {
    "wrong-shape": (lambda s: s[:, :1], r"kv_scale must be \[2, num_kv_heads=2\], got \[2, 1\]"),
    "rows": (lambda s: np.concatenate([s, s]), r"kv_scale must be \[2, num_kv_heads=2\], got \[4, 2\]"),
    "zero": (
        lambda s: np.where(np.arange(4).reshape(2, 2) == 3, 0, s).astype(np.float32),
        r"kv_scale\[1\]\[1\] = 0.0+ must be positive",
    ),
    "nan": (lambda s: np.full_like(s, np.nan), r"kv_scale\[0\]\[0\] = nan must be positive and finite"),
}


@pytest.mark.parametrize("what", sorted(KV_SCALE_ERRORS))
def test_int8_bad_kv_scale_raises(what):
    rng = np.random.default_rng(13)
    feeds = make_case(rng, [(3, 4), (20, 1)], op_case(4, 2, 16, 16, "int8"))
    model = make_single_op_model(PagedAttentionAttrs(4, 2), 16, 16, kv_dtype=np.int8)
    model.graph.input[-1].type.tensor_type.shape.dim[0].dim_param = "two"
    model.graph.input[-1].type.tensor_type.shape.dim[1].dim_param = "hkv"
    change, message = KV_SCALE_ERRORS[what]
    with pytest.raises(Exception, match=r"kiln\.PagedAttention: .*" + message):
        model_session(model).run(None, {**feeds, KV_SCALE: change(feeds[KV_SCALE])})


def test_int8_without_kv_scale_raises():
    rng = np.random.default_rng(14)
    feeds = make_case(rng, [(3, 4)], op_case(4, 2, 16, 16, "int8"))
    del feeds[KV_SCALE]
    model = make_single_op_model(PagedAttentionAttrs(4, 2), 16, 16, kv_dtype=np.int8)
    sess = model_session(_retype(model, drop_kv_scale=True))
    with pytest.raises(Exception, match="kiln.PagedAttention: an int8 kv_cache needs the 8th input kv_scale"):
        sess.run(None, feeds)


def test_float_pool_with_kv_scale_raises():
    rng = np.random.default_rng(15)
    feeds = make_case(rng, [(3, 4)], op_case(4, 2, 16, 16))
    sess = model_session(_retype(make_single_op_model(PagedAttentionAttrs(4, 2), 16, 16), add_kv_scale=True))
    with pytest.raises(Exception, match="kiln.PagedAttention: kv_scale is only for an int8 kv_cache"):
        sess.run(None, {**feeds, KV_SCALE: np.ones((2, 2), np.float32)})


def test_int8_in_place_touches_only_new_slots():
    rng = np.random.default_rng(16)
    op = op_case(4, 2, 16, 16, "int8")
    feeds = make_case(rng, [(33, 2), (0, 5)], op, spare_blocks=50)
    before = feeds["kv_cache"].copy()
    _, expected_pool = reference(feeds, op)
    run_in_place(session(op), feeds)
    assert np.array_equal(feeds["kv_cache"], expected_pool)
    changed = {tuple(x) for x in np.argwhere((feeds["kv_cache"] != before).any(axis=(1, 2, 4))).tolist()}
    allowed = {(int(feeds["block_tables"][0, p // 16]), p % 16) for p in (33, 34)}
    allowed |= {(int(feeds["block_tables"][1, 0]), p) for p in range(5)}
    assert changed <= allowed and changed


def test_heads_not_divisible_raise():
    message = "num_heads \\(4\\) must be a positive multiple of num_kv_heads \\(3\\)"
    with pytest.raises(ValueError, match=message):
        PagedAttentionAttrs(4, 3)
    # The kernel gets the bad attribute from a graph: 4 query heads (64 wide) over 3 KV heads.
    rng = np.random.default_rng(6)
    feeds = make_case(rng, [(0, 3)], op_case(3, 3, 16, 16))
    feeds["query"] = rng.standard_normal((3, 4 * 16), dtype=np.float32)
    model = make_single_op_model(PagedAttentionAttrs(3, 3), 16, 16)
    make_symbolic(model)
    next(a for a in model.graph.node[0].attribute if a.name == "num_heads").i = 4
    with pytest.raises(Exception, match=message):
        model_session(model).run(None, feeds)


def test_abi_version_matches_contract():
    from kiln.contract import OP_LIBRARY_ABI

    assert ops.check_abi() == OP_LIBRARY_ABI


# ------------------------------------------------------------------ RoPE inside the op


def rotary_case(num_heads, num_kv_heads, head_dim, kv_dtype="float32", positions=512, interleaved=0):
    attrs = PagedAttentionAttrs(num_heads, num_kv_heads, rotary_interleaved=interleaved)
    return OpCase(attrs, head_dim, 16, kv_dtype, rotary_positions=positions)


def check_rotary(out, pool, ref_out, ref_pool, kv_dtype):
    """As check, but new K slots may differ by the rotation's rounding (FMA or not) carried into the pool's dtype."""
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=5e-5)
    if kv_dtype == "int8":
        diff = np.abs(pool.astype(np.int32) - ref_pool.astype(np.int32))
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, "the int8 pool differs beyond rounding"
    else:
        np.testing.assert_allclose(pool.astype(np.float32), ref_pool.astype(np.float32),
                                   rtol=1e-3 if kv_dtype == "float16" else 1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [16, 12])
def test_reference_rotary_equals_prerotated_inputs(interleaved, rotary_dim):
    """Independent check of the spec: RoPE inside == the op without RoPE fed Q/K rotated beforehand
    (the rotation written out per token here, pair by pair, partial rotary dims included)."""
    rng = np.random.default_rng(21)
    H, Hkv, D = 6, 2, 16
    op = rotary_case(H, Hkv, D, positions=64, interleaved=interleaved)
    feeds = make_case(rng, [(0, 9), (40, 1), (17, 5)], op)
    cos, sin = rotary_tables(64, rotary_dim)
    feeds["cos_cache"], feeds["sin_cache"] = cos, sin
    rotated = {n: feeds[n].copy() for n in ("query", "key")}
    for t, pos in enumerate(token_positions(feeds["seq_lens"], feeds["query_start_loc"])):
        for name in rotated:
            heads = rotated[name][t].reshape(-1, D)
            for j in range(rotary_dim // 2):
                a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + rotary_dim // 2)
                x, y = heads[:, a].copy(), heads[:, b].copy()
                heads[:, a], heads[:, b] = x * cos[pos, j] - y * sin[pos, j], y * cos[pos, j] + x * sin[pos, j]
    plain = {n: v for n, v in feeds.items() if n not in ROTARY_INPUTS}
    out, pool = paged_attention_ref(PagedAttentionInputs(**feeds), op.attrs)
    ref_out, ref_pool = paged_attention_ref(PagedAttentionInputs(**{**plain, **rotated}), op.attrs)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pool, ref_pool, rtol=1e-6, atol=1e-6)


def test_apply_rotary_keeps_norms_and_position_zero():
    rng = np.random.default_rng(22)
    x = rng.standard_normal((5, 3, 16), dtype=np.float32)
    cos, sin = rotary_tables(5, 16)
    for interleaved in (0, 1):
        y = apply_rotary(x, cos, sin, interleaved)
        np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
        np.testing.assert_array_equal(y[0], x[0])  # position 0: cos 1, sin 0


@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_kernel_rotary_mixed_batch(heads, kv_dtype):
    """Prefill chunks and decodes in one ragged batch, positions far past the first block."""
    rng = np.random.default_rng(23)
    op = rotary_case(*heads, 64, kv_dtype)
    feeds = make_case(rng, MIXED, op)
    out, pool = session(op).run(None, feeds)
    check_rotary(out, pool, *reference(feeds, op), kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_kernel_rotary_long_decode_and_partial_dims(kv_dtype):
    """A split long-context decode (flash-decoding partitions), odd head dims and rotary dims < head_dim."""
    rng = np.random.default_rng(24)
    op = rotary_case(6, 2, 20, kv_dtype, positions=4096)
    feeds = make_case(rng, [(4000, 1), (0, 19), (2047, 3)], op, spare_blocks=10)
    feeds["cos_cache"], feeds["sin_cache"] = rotary_tables(4096, 12)
    out, pool = session(op).run(None, feeds)
    check_rotary(out, pool, *reference(feeds, op), kv_dtype)


def test_kernel_rotary_interleaved():
    rng = np.random.default_rng(25)
    op = rotary_case(8, 2, 32, interleaved=1)
    feeds = make_case(rng, [(0, 21), (70, 1)], op)
    out, pool = session(op).run(None, feeds)
    check_rotary(out, pool, *reference(feeds, op), "float32")


def test_kernel_rotary_prefill_then_decode_matches_one_prefill():
    """K in the pool is post-RoPE: decoding after a chunked prefill equals attending over one prefill."""
    rng = np.random.default_rng(26)
    op = rotary_case(4, 2, 32)
    whole = make_case(rng, [(0, 12)], op)
    out_whole, _ = session(op).run(None, whole)
    pool = whole["kv_cache"]
    for lo, hi in ((0, 7), (7, 11), (11, 12)):
        step = {**whole, "kv_cache": pool, "seq_lens": np.array([hi], np.int32),
                "query_start_loc": np.array([0, hi - lo], np.int32),
                **{n: whole[n][lo:hi] for n in ("query", "key", "value")}}
        out, pool = session(op).run(None, step)
        np.testing.assert_allclose(out, out_whole[lo:hi], rtol=1e-5, atol=1e-5)


def test_kernel_rotary_position_past_cache_raises():
    op = rotary_case(4, 2, 16, positions=32)
    feeds = make_case(np.random.default_rng(27), [(0, 4), (31, 2)], op)
    with pytest.raises(Exception, match="position 32 is past the cos/sin cache"):
        session(op).run(None, feeds)
    with pytest.raises(ValueError, match="past the cos/sin cache"):
        reference(feeds, op)


@pytest.mark.parametrize("what", ["one-missing", "too-wide", "mismatched"])
def test_kernel_rotary_bad_caches_raise(what):
    op = rotary_case(4, 2, 16, positions=32)
    feeds = make_case(np.random.default_rng(28), [(0, 4)], op)
    cos, sin = feeds["cos_cache"], feeds["sin_cache"]
    bad = {"one-missing": {"sin_cache": np.zeros((0, 0), np.float32)},
           "too-wide": {"cos_cache": np.tile(cos, 2), "sin_cache": np.tile(sin, 2)},
           "mismatched": {"sin_cache": sin[:, :4]}}[what]
    with pytest.raises(Exception, match="cos_cache and sin_cache"):
        session(op, symbolic=True).run(None, {**feeds, **bad})


# ------------------------------------------------------------------ packed Q|K|V and the batch of one


def layout_session(op, packed, batch_of_one):
    model = make_single_op_model(op.attrs, op.head_dim, op.block_size, np.dtype(op.kv_dtype),
                                 op.rotary_positions > 0, QkvLayout(packed, batch_of_one))
    return model_session(model)


def laid_out(feeds, packed, batch_of_one):
    """feeds with query/key/value in the given layout (packed: one [T, (H + 2Hkv)D] query, no key/value)."""
    qkv = {k: feeds[k] for k in ("query", "key", "value")}
    if packed:
        qkv = {"query": np.concatenate([qkv["query"], qkv["key"], qkv["value"]], axis=1)}
    if batch_of_one:
        qkv = {k: v[None] for k, v in qkv.items()}
    rest = {k: v for k, v in feeds.items() if k not in ("query", "key", "value")}
    return {**qkv, **rest}


@pytest.mark.parametrize("layout", [(True, False), (False, True), (True, True)],
                         ids=["packed", "batch-of-one", "packed-batch-of-one"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("rotary", [False, True])
def test_kernel_packed_and_batch_of_one_layouts(layout, kv_dtype, rotary):
    """The same attention and pool as separate [T, width] inputs, for SmolLM2's 9/3 heads: a packed row's
    key and value heads read at the right offsets (a wrong stride or offset reads query heads as keys)."""
    packed, batch_of_one = layout
    op = rotary_case(9, 3, 64, kv_dtype) if rotary else op_case(9, 3, 64, 16, kv_dtype)
    feeds = make_case(np.random.default_rng(31), MIXED, op)
    out, pool = layout_session(op, packed, batch_of_one).run(None, laid_out(feeds, packed, batch_of_one))
    ref_out, ref_pool = reference(feeds, op)
    assert out.shape == ((1, *ref_out.shape) if batch_of_one else ref_out.shape)
    if rotary:
        check_rotary(out.reshape(ref_out.shape), pool, ref_out, ref_pool, kv_dtype)
    else:
        check(out.reshape(ref_out.shape), pool, ref_out, ref_pool)
    empty = np.zeros(0, np.float32)
    spec_feeds = {"key": empty, "value": empty, **laid_out(feeds, packed, batch_of_one)}
    ref_laid_out, _ = paged_attention_ref(PagedAttentionInputs(**spec_feeds), op.attrs)
    np.testing.assert_array_equal(ref_laid_out.reshape(ref_out.shape), ref_out)  # the spec: layout only


LAYOUT_ERRORS = {
    "only-key-empty": ({"key": np.zeros(0, np.float32)}, "key and value are both empty"),
    "batch-of-two": ({"query": np.zeros((2, 3, 64), np.float32)}, r"a rank-3 query must be \[1, num_tokens, width\]"),
    "packed-width": ({"query": np.zeros((7, 64 + 1), np.float32), "key": np.zeros(0, np.float32),
                      "value": np.zeros(0, np.float32)}, r"query must be \[num_tokens, \(num_heads\+2\*num_kv_heads\)"),
}


@pytest.mark.parametrize("what", sorted(LAYOUT_ERRORS))
def test_bad_qkv_layouts_raise(what):
    op = op_case(4, 2, 16, 16)
    feeds = make_case(np.random.default_rng(32), [(3, 4), (0, 3)], op)
    model = make_single_op_model(op.attrs, op.head_dim, op.block_size)
    for value_info in model.graph.input[:3]:  # any rank through to the kernel's validation
        del value_info.type.tensor_type.shape.dim[:]
    bad, message = LAYOUT_ERRORS[what]
    with pytest.raises(Exception, match=r"kiln\.PagedAttention: .*" + message):
        model_session(model).run(None, {**feeds, **bad})


# ------------------------------------------------------------------ q/k RMSNorm inside the op


def norm_weights(rng, op, per_head):
    """q_norm / k_norm of the op's heads: [D] (per head, Qwen3) or the projections' widths (OLMoE)."""
    heads = (1, 1) if per_head else (op.attrs.num_heads, op.attrs.num_kv_heads)
    return {name: rng.uniform(0.5, 1.5, h * op.head_dim).astype(np.float32)
            for name, h in zip(QK_NORM_INPUTS, heads, strict=True)}


def test_reference_norms_equal_prenormalised_inputs():
    """Independent check of the spec: q/k norms inside == the op without them fed q/k normalised beforehand (per
    head and over the row, written out here), the norm before RoPE."""
    rng = np.random.default_rng(41)
    op = rotary_case(6, 2, 16, positions=64)
    feeds = make_case(rng, [(0, 9), (40, 1)], op)
    eps = op.attrs.qk_norm_epsilon
    for per_head in (True, False):
        weights = norm_weights(rng, op, per_head)
        normed = {}
        for name, w in zip(("query", "key"), weights.values(), strict=True):
            x = feeds[name].astype(np.float64).reshape(len(feeds[name]), -1, len(w))
            normed[name] = (x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w).reshape(len(x), -1)
        out, pool = paged_attention_ref(PagedAttentionInputs(**feeds, **weights), op.attrs)
        ref_out, ref_pool = paged_attention_ref(PagedAttentionInputs(**{**feeds, **normed}), op.attrs)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pool, ref_pool, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "whole-row"])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_kernel_qk_norms(per_head, packed, kv_dtype):
    """The kernel's norms against the spec, with RoPE after them, mixed prefill and decode rows; a packed row's value
    heads pass through unnormalised. A norm dropped, or applied per head where the row is meant, fails this."""
    rng = np.random.default_rng(42)
    op = rotary_case(8, 2, 32, kv_dtype)
    op = OpCase(dataclasses.replace(op.attrs, qk_norm_epsilon=1e-5), op.head_dim, op.block_size, op.kv_dtype,
                op.rotary_positions)
    feeds = make_case(rng, MIXED, op)
    weights = norm_weights(rng, op, per_head)
    model = make_single_op_model(op.attrs, op.head_dim, op.block_size, np.dtype(kv_dtype), True,
                                 QkvLayout(packed=packed, qk_norm=True))
    out, pool = model_session(model).run(None, {**laid_out(feeds, packed, False), **weights})
    ref_out, ref_pool = paged_attention_ref(PagedAttentionInputs(**feeds, **weights), op.attrs)
    check_rotary(out, pool, ref_out, ref_pool, kv_dtype)
    if per_head:  # the same weights over each whole row: another normalisation, which the check tells apart
        tiled = {name: np.tile(w, heads) for (name, w), heads in zip(weights.items(), (8, 2), strict=True)}
        wrong, _ = paged_attention_ref(PagedAttentionInputs(**feeds, **tiled), op.attrs)
        assert np.abs(wrong - ref_out).max() > 100 * np.abs(out - ref_out).max()
    unnormed, _ = reference(feeds, op)
    assert np.abs(unnormed - ref_out).max() > 100 * np.abs(out - ref_out).max()


def test_kernel_bad_qk_norm_width_raises():
    op = rotary_case(4, 2, 16)
    feeds = make_case(np.random.default_rng(43), [(3, 4)], op)
    model = make_single_op_model(op.attrs, op.head_dim, op.block_size, np.float32, True, QkvLayout(qk_norm=True))
    weights = {"q_norm": np.ones(16 * 3, np.float32), "k_norm": np.ones(16, np.float32)}
    with pytest.raises(Exception, match=r"kiln\.PagedAttention: q_norm must be float32 \[head_dim=16\]"):
        model_session(model).run(None, {**feeds, **weights})
