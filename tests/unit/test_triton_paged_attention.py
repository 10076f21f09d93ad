"""The Triton kernels of kiln.PagedAttention (plugins_trt/) against the reference, in Triton's CPU interpreter.

Small shapes (SmolLM2's 9 query / 3 KV heads x 64), ragged batches that mix a prefill chunk over a cached
prefix, decode tokens, an empty sequence and a fresh prompt crossing blocks, block sizes 16 and 32, shuffled
block tables in a pool larger than what the batch uses; float32, float16, bfloat16, int8 and fp8 pools, RoPE
in the op, sliding window, and the split-context kernel with its merge. The interpreter runs each program in
numpy, so every case is a few seconds: keep them few and small. The GPU twin of this file is
tests/gpu/test_triton_kernels_gpu.py.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it once
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kiln.paged_attention import PagedAttentionInputs, paged_attention_ref  # noqa: E402
from kiln.plugins_trt.cases import Case, make_inputs, new_slots  # noqa: E402
from kiln.plugins_trt.launcher import DeviceInputs, check_inputs, paged_attention  # noqa: E402
from kiln.plugins_trt.plan import AttentionPlan, plan_attention  # noqa: E402

MIXED = dict(q_lens=(5, 1, 0, 19, 1), context_lens=(3, 40, 10, 0, 17))  # chunk, decode, empty, prompt, decode


def run(case: Case, pool_dtype: torch.dtype, plan: AttentionPlan | None = None, seed: int = 0):
    """(kernel out, kernel pool as float32, reference out, reference pool as float32, the reference's inputs)."""
    inputs = make_inputs(case, seed)
    device = DeviceInputs.from_reference(inputs, "cpu", pool_dtype if not case.int8 else None)
    # the reference sees the pool the kernel starts from (rounded to pool_dtype)
    start = device.kv_cache.float().numpy() if not case.int8 else inputs.kv_cache
    ref_inputs = PagedAttentionInputs(**{**inputs.__dict__, "kv_cache": start.astype(start.dtype)})
    ref_out, ref_pool = paged_attention_ref(ref_inputs, case.attrs)
    out = paged_attention(device, case.attrs, plan)
    return out.numpy(), device.kv_cache.float().numpy(), ref_out, ref_pool.astype(np.float32), inputs


def rounded(pool: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(pool).to(dtype).float().numpy()


@pytest.mark.parametrize(("block_size", "pool_dtype", "rotary", "tol"), [
    (16, torch.float32, -1, 1e-5),
    (32, torch.float16, 0, 1e-2),
])
def test_mixed_batch_matches_reference(block_size, pool_dtype, rotary, tol):
    case = Case(**MIXED, block_size=block_size, rotary=rotary)
    out, pool, ref_out, ref_pool, inputs = run(case, pool_dtype)
    np.testing.assert_allclose(out, ref_out, atol=tol, rtol=tol)
    # the new tokens' slots hold the reference's K/V (rounded to the pool), every other slot is untouched
    np.testing.assert_allclose(pool, rounded(ref_pool, pool_dtype), atol=1e-6)
    blocks, slots = new_slots(inputs)
    assert len(set(zip(blocks.tolist(), slots.tolist(), strict=True))) == len(blocks)


def test_int8_pool_window_interleaved_rope_small_tiles():
    """int8 KV with per-head steps (K quantized after RoPE), a sliding window that starts inside a block,
    adjacent-pair RoPE, and 16-token tiles over 16-token blocks (a tile per block)."""
    case = Case(**MIXED, block_size=16, sliding_window=13, rotary=1, int8=True)
    out, pool, ref_out, ref_pool, _ = run(case, torch.int8, AttentionPlan(block_q=4, group_pad=4, tile=16))
    np.testing.assert_array_equal(pool, ref_pool)  # quantization is exact: same rounding, same clamp
    np.testing.assert_allclose(out, ref_out, atol=1e-2, rtol=1e-2)


def test_split_context_merges_to_the_reference():
    """Flash-decoding: three decode tokens over contexts of 70-150 positions (32-token blocks), each context cut
    into 4 ranges of 16-position tiles (some empty for the shortest), merged."""
    case = Case(q_lens=(1, 1, 1), context_lens=(149, 69, 100), block_size=32)
    plan = AttentionPlan(block_q=4, group_pad=4, tile=16, num_splits=4)
    out, pool, ref_out, ref_pool, _ = run(case, torch.float16, plan)
    np.testing.assert_allclose(out, ref_out, atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(pool, rounded(ref_pool, torch.float16), atol=1e-6)


def test_bfloat16_and_fp8_pools():
    """bfloat16 rounds the written K/V (its attention output is checked on the GPU only: the interpreter's
    tl.dot reads bfloat16 operands as their raw bits); fp8 (e4m3) stores clamp(x / step) with the per-head steps
    of an int8 pool (the reference has no fp8 pool: it runs on the float32 values the fp8 pool holds)."""
    case = Case(q_lens=(3, 1), context_lens=(14, 20), block_size=16)
    _, pool, _, ref_pool, _ = run(case, torch.bfloat16)
    # within one bfloat16 step: the interpreter's float32 -> bfloat16 cast truncates where torch rounds
    np.testing.assert_allclose(pool, rounded(ref_pool, torch.bfloat16), rtol=2**-7, atol=1e-6)

    inputs = make_inputs(case, seed=1)
    fp8, steps = torch.float8_e4m3fn, torch.tensor([[0.02, 0.03, 0.05], [0.04, 0.01, 0.02]])
    per_head = steps[None, :, :, None, None]  # [1, 2 (K, V), Hkv, 1, 1] over the pool

    def e4m3(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """x [T, Hkv, D] as an fp8 pool holds it, read back: e4m3(clamp(x / step, +-448)) * step."""
        return (x / step[:, None]).clamp(-448, 448).to(fp8).float() * step[:, None]

    base = DeviceInputs.from_reference(inputs, "cpu")
    device = DeviceInputs(**{**base.__dict__, "kv_cache": (base.kv_cache / per_head).to(fp8), "kv_scale": steps})
    start = device.kv_cache.float() * per_head
    out = paged_attention(device, case.attrs).numpy()
    k, v = (torch.from_numpy(x).view(len(x), 3, 64) for x in (inputs.key, inputs.value))
    ref_inputs = PagedAttentionInputs(**{**inputs.__dict__, "kv_cache": start.numpy(),
                                         "key": e4m3(k, steps[0]).flatten(1).numpy(),
                                         "value": e4m3(v, steps[1]).flatten(1).numpy()})
    ref_out, ref_pool = paged_attention_ref(ref_inputs, case.attrs)
    written = (device.kv_cache.float() * per_head).numpy()
    # The interpreter's own float32 -> e4m3 cast loses the carry into the exponent when it rounds up to a power
    # of two (it gives half of it); the GPU's cvt does not, and tests/gpu checks the pool exactly.
    off = ~np.isclose(written, ref_pool, atol=1e-6)
    assert off.mean() < 1e-3 and np.allclose(2 * written[off], ref_pool[off])
    # so attention is checked against the reference fed the K/V the kernel wrote
    blocks, slots = new_slots(inputs)
    as_written = {name: written[blocks, i, :, slots, :].reshape(len(blocks), -1)
                  for i, name in enumerate(("key", "value"))}
    ref_out, _ = paged_attention_ref(PagedAttentionInputs(**{**ref_inputs.__dict__, **as_written}), case.attrs)
    np.testing.assert_allclose(out, ref_out, atol=2e-2, rtol=2e-2)


def test_bad_inputs_are_named_before_a_launch():
    inputs = make_inputs(Case(q_lens=(2,), context_lens=(20,)))
    for change, message in [
        ({"seq_lens": np.array([1], np.int32)}, "at least its sequence's number of new tokens"),
        ({"query_start_loc": np.array([0, 3], np.int32)}, "query_start_loc must rise"),
        ({"block_tables": np.full((1, 3), 99, np.int32)}, "outside the pool"),
    ]:
        bad = DeviceInputs.from_reference(PagedAttentionInputs(**{**inputs.__dict__, **change}), "cpu")
        with pytest.raises(ValueError, match=message):
            check_inputs(bad, Case(q_lens=(2,), context_lens=(20,)).attrs)
    with pytest.raises(ValueError, match="kv_scale"):
        DeviceInputs.from_reference(inputs, "cpu", torch.int8)
    capped = dataclasses.replace(Case(q_lens=(2,), context_lens=(20,)).attrs, softcap=50.0)
    with pytest.raises(ValueError, match="do not implement the attention logit soft-cap"):
        check_inputs(DeviceInputs.from_reference(inputs, "cpu"), capped)


def test_plan_splits_only_small_decode_batches():
    assert plan_attention(1, 1, 3, 3, max_context=16384).num_splits == 64
    assert plan_attention(1, 1, 4, 8, max_context=65536).num_splits == 64  # 8 programs x 64 = 4 per SM
    assert plan_attention(4, 4, 4, 8, max_context=65536).num_splits == 16
    assert plan_attention(16, 16, 4, 8, max_context=65536).num_splits == 4
    assert plan_attention(64, 64, 3, 3).num_splits == 2  # 192 programs, under 2 per SM: 384
    assert plan_attention(64, 64, 4, 8).num_splits == 1  # 512 programs: ~4 per SM unsplit
    assert plan_attention(300, 4, 3, 3).num_splits == 1  # prefill: enough query blocks
    assert plan_attention(1, 1, 3, 3, max_context=100).num_splits == 1  # one tile: nothing to split
    assert plan_attention(1, 1, 4, 8, max_context=1024).num_splits == 8  # 16 tiles, 2 a split
    with pytest.raises(ValueError, match="power of two"):
        AttentionPlan(block_q=3, group_pad=4, tile=16)
