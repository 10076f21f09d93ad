"""kiln.SwiGLU: the numpy reference against silu(gate) * up written out, and the ONNX Runtime CPU kernel
(libkiln_ops.so) against the reference: ranks 1-3, SmolLM2's F = 1536 and odd F, large |x|, the thread pool's
row split, errors on bad shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.swiglu import make_single_op_model, swiglu_ref

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()


def session(rank: int, threads: int = 1):
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(make_single_op_model(rank).SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(x: np.ndarray, threads: int = 1) -> np.ndarray:
    return session(x.ndim, threads).run(None, {"x": x})[0]


def test_reference_is_silu_of_the_first_half_times_the_second():
    x = np.random.default_rng(0).standard_normal((3, 10)).astype(np.float32)
    gate, up = x[:, :5].astype(np.float64), x[:, 5:].astype(np.float64)
    np.testing.assert_allclose(swiglu_ref(x), gate / (1 + np.exp(-gate)) * up, rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (7, 2 * 1536), (2, 3, 2 * 1536), (4, 10), (2, 5, 2 * 13),
                                   (3, 2), (16,)])
def test_kernel_matches_reference(shape):
    """Full 8-lane blocks and masked tails (F = 5, 13, 1), ranks 1 to 3."""
    x = (np.random.default_rng(1).standard_normal(shape) * 4).astype(np.float32)
    y = run(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == np.float32
    np.testing.assert_allclose(y, swiglu_ref(x), rtol=2e-6, atol=1e-7)


def test_gate_is_the_first_half():
    """Swapping the halves changes silu(gate) * up: a kernel reading them the other way round fails here."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2 * 21)).astype(np.float32)
    y = run(x)
    swapped = np.concatenate([x[:, 21:], x[:, :21]], axis=1)
    np.testing.assert_allclose(y, swiglu_ref(x), rtol=2e-6, atol=1e-7)
    assert np.abs(y - swiglu_ref(swapped)).max() > 0.1


def test_large_inputs_stay_finite():
    """exp(-|a|) never overflows: silu(100) = 100, silu(-100) ~ -0, and up to float32's largest values (around
    -87, where exp256 clamps, too)."""
    gate = np.array([100, -100, 88, -88, 1e4, -1e4, 3e38, -3e38, 0, -0.0, 1e-30, -1e-30, 20, -20, -86.5, -87.5],
                    np.float32)
    up = np.ones_like(gate)
    x = np.concatenate([gate, up])[None]
    y = run(x)[0]
    assert np.all(np.isfinite(y))
    assert y[0] == 100 and y[2] == 88 and y[4] == 1e4 and y[6] == np.float32(3e38)
    assert np.all(np.abs(y[[1, 3, 5, 7, 14, 15]]) < 1e-30) and np.all(y[[1, 3, 5, 7, 14, 15]] <= 0)
    np.testing.assert_allclose(y, swiglu_ref(x)[0], rtol=2e-6, atol=1e-30)


def test_rows_split_over_the_thread_pool():
    """Enough rows for the pool (and a last work item with fewer rows): the same values as one thread."""
    x = np.random.default_rng(3).standard_normal((61, 2 * 1536)).astype(np.float32)
    one, two = run(x, threads=1), run(x, threads=2)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_allclose(two, swiglu_ref(x), rtol=2e-6, atol=1e-7)


def test_empty_batch():
    assert run(np.zeros((0, 8), np.float32)).shape == (0, 4)


@pytest.mark.parametrize("shape", [(2, 7), (5,)])
def test_odd_width_is_refused(shape):
    with pytest.raises(Exception, match=r"kiln.SwiGLU: x must be \[\.\.\., 2F\] with an even last dimension, got \["):
        run(np.zeros(shape, np.float32))
