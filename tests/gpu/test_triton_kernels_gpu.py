"""The compiled Triton kernels on a CUDA GPU against the reference (skipped without one).

The interpreter tests (tests/unit/test_triton_paged_attention.py) check the same semantics on the CPU;
these run the PTX that Triton compiles for the GPU at hand, at SmolLM2's shapes and at larger ones, for every
pool dtype (bfloat16 and fp8 included, which the interpreter cannot fully run), the split-context kernel, and
the AOT compile for this GPU's architecture. `make gpu-check` runs this file.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)", allow_module_level=True)

from kiln.paged_attention import PagedAttentionInputs, paged_attention_ref, rotate_query_key  # noqa: E402
from kiln.plugins_trt.cases import Case, make_inputs  # noqa: E402
from kiln.plugins_trt.launcher import DeviceInputs, paged_attention  # noqa: E402
from kiln.plugins_trt.plan import AttentionPlan, plan_attention  # noqa: E402

pytestmark = pytest.mark.gpu
MIXED = dict(q_lens=(5, 1, 0, 70, 1, 33), context_lens=(3, 400, 10, 0, 17, 129))
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def check_float_pool(case: Case, pool_dtype: torch.dtype, plan: AttentionPlan | None = None) -> None:
    inputs = make_inputs(case)
    device = DeviceInputs.from_reference(inputs, "cuda", pool_dtype)
    start = device.kv_cache.float().cpu().numpy()
    ref_out, ref_pool = paged_attention_ref(PagedAttentionInputs(**{**inputs.__dict__, "kv_cache": start}),
                                            case.attrs)
    out = paged_attention(device, case.attrs, plan)
    torch.cuda.synchronize()
    expected_pool = torch.from_numpy(ref_pool).to(pool_dtype).float().numpy()
    np.testing.assert_allclose(device.kv_cache.float().cpu().numpy(), expected_pool, atol=1e-6, rtol=2**-8)
    tol = TOLERANCE[pool_dtype]
    np.testing.assert_allclose(out.cpu().numpy(), ref_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_float_pools(pool_dtype, block_size):
    check_float_pool(Case(**MIXED, block_size=block_size, rotary=0), pool_dtype)


def test_sliding_window_interleaved_rope_and_a_head_dim_that_is_not_a_power_of_two():
    check_float_pool(Case(**MIXED, sliding_window=37, rotary=1, head_dim=80, num_heads=8, num_kv_heads=1),
                     torch.float16)


@pytest.mark.parametrize("num_splits", [2, 8, 16, 64, 128])
def test_split_context(num_splits):
    case = Case(q_lens=(1, 1, 1), context_lens=(4000, 1500, 37), block_size=16)
    check_float_pool(case, torch.float16, AttentionPlan(block_q=4, group_pad=4, tile=64, num_splits=num_splits))


def test_int8_pool():
    case = Case(**MIXED, int8=True, rotary=0, sliding_window=50)
    inputs = make_inputs(case)
    device = DeviceInputs.from_reference(inputs, "cuda")
    ref_out, ref_pool = paged_attention_ref(inputs, case.attrs)
    out = paged_attention(device, case.attrs)
    pool = device.kv_cache.cpu().numpy().astype(np.int32)
    # the GPU may fuse RoPE's multiply-adds: a value on a rounding boundary may land one step away
    assert np.abs(pool - ref_pool.astype(np.int32)).max() <= 1
    np.testing.assert_allclose(out.cpu().numpy(), ref_out, atol=1e-2, rtol=1e-2)


def test_fp8_pool_quantizes_the_rotated_key():
    case = Case(**MIXED, rotary=0)
    inputs = make_inputs(case)
    steps = torch.tensor([[0.02, 0.03, 0.05], [0.04, 0.01, 0.02]], device="cuda")
    per_head = steps[None, :, :, None, None]
    base = DeviceInputs.from_reference(inputs, "cuda")
    device = DeviceInputs(**{**base.__dict__, "kv_cache": (base.kv_cache / per_head).to(torch.float8_e4m3fn),
                             "kv_scale": steps})
    start = (device.kv_cache.float() * per_head).cpu().numpy()

    def e4m3(x: np.ndarray, step: torch.Tensor) -> np.ndarray:
        heads = torch.from_numpy(x).cuda().view(len(x), 3, 64)
        rounded = (heads / step[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * step[:, None]
        return rounded.flatten(1).cpu().numpy()

    # The kernel rotates, then rounds to e4m3: the reference gets the rotated query and rounded key/value, no RoPE.
    query, key = rotate_query_key(inputs, case.attrs)
    ref_inputs = PagedAttentionInputs(**{**inputs.__dict__, "kv_cache": start, "query": query,
                                         "key": e4m3(key, steps[0]), "value": e4m3(inputs.value, steps[1]),
                                         "cos_cache": None, "sin_cache": None})
    ref_out, ref_pool = paged_attention_ref(ref_inputs, case.attrs)
    out = paged_attention(device, case.attrs)
    pool = (device.kv_cache.float() * per_head).cpu().numpy()
    # the GPU may fuse RoPE's multiply-adds: a value on a rounding boundary may land one e4m3 step away
    off = ~np.isclose(pool, ref_pool, rtol=0, atol=1e-6)
    assert off.mean() < 1e-3
    np.testing.assert_allclose(pool[off], ref_pool[off], rtol=2**-3 + 1e-6)
    np.testing.assert_allclose(out.cpu().numpy(), ref_out, atol=2e-2, rtol=2e-2)


def test_planned_decode_at_long_context_uses_splits_and_matches():
    case = Case(q_lens=(1,), context_lens=(8191,), block_size=16)
    plan = plan_attention(1, 1, 3, 3, max_context=8192)
    assert plan.num_splits > 1
    check_float_pool(case, torch.float16, plan)


def test_aot_ptx_for_this_gpu(tmp_path):
    from kiln.plugins_trt.aot import compile_all

    major, minor = torch.cuda.get_device_capability()
    records = compile_all(tmp_path, (major * 10 + minor,))
    assert all(r["threads"] > 0 for r in records)
