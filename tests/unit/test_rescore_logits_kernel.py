"""kiln.RescoreLogits: the numpy reference against TopK + dequantized rows written out, and the ONNX Runtime CPU
kernel (libkiln_ops.so) against the reference: SmolLM2's vocabulary and width, several rows and ranks, ties at
the k-th value, NaN and -inf logits, k at or past the vocabulary, and errors on bad shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.rescore_logits import make_single_op_model, rescore_logits_ref, top_k_ids

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()


def table(vocab: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    blocks = width // 32
    data = rng.integers(0, 256, (vocab, width), dtype=np.uint8)
    scales = (rng.random((vocab, blocks)) * 0.02 + 1e-3).astype(np.float32)
    zero_points = rng.integers(0, 256, (vocab, blocks), dtype=np.uint8)
    return data, scales, zero_points


def run(approx: np.ndarray, hidden: np.ndarray, tables, k: int, threads: int = 1) -> np.ndarray:
    data, scales, zero_points = tables
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads  # rows are spread over the pool's threads
    so.register_custom_ops_library(LIBRARY)
    model = make_single_op_model(k, rank=approx.ndim)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {"approx": approx, "hidden": hidden, "data": data, "scales": scales, "zero_points": zero_points}
    return sess.run(None, feeds)[0]


def test_reference_rescores_the_k_largest_from_the_dequantized_rows():
    vocab, width, k = 40, 64, 5
    data, scales, zero_points = tables = table(vocab, width)
    rng = np.random.default_rng(1)
    approx = rng.standard_normal((2, vocab)).astype(np.float32)
    hidden = rng.standard_normal((2, width)).astype(np.float32)
    rows = (data.astype(np.float64) - np.repeat(zero_points, 32, axis=1)) * np.repeat(scales, 32, axis=1)
    out = rescore_logits_ref(approx, hidden, *tables, k)
    for r in range(2):
        top = np.argsort(-approx[r])[:k]
        expected = approx[r].copy()
        expected[top] = rows[top] @ hidden[r]
        np.testing.assert_allclose(out[r], expected, rtol=1e-6)


def test_top_k_ids_break_ties_towards_the_lower_id_and_skip_nan():
    row = np.array([1, 3, np.nan, 3, 2, 3, -np.inf], dtype=np.float32)
    assert top_k_ids(row, 2).tolist() == [1, 3]
    assert top_k_ids(row, 4).tolist() == [1, 3, 5, 4]
    assert sorted(top_k_ids(row, 10).tolist()) == [0, 1, 3, 4, 5, 6]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("shape, k", [((1, 49152), 256), ((5, 49152), 256), ((2, 3, 1000), 7), ((1, 64), 64),
                                      ((1, 100), 150), ((3, 130), 1), ((4, 2000), 40)])
def test_kernel_matches_reference(shape, k, threads):
    """SmolLM2's head (V = 49,152, D = 576, k = 256) and small ones: k under, at and past the vocabulary,
    vocabularies that are and are not a multiple of the kernel's group of 64, ranks 2 and 3; rows on one
    thread and spread over three."""
    vocab, width = shape[-1], 576 if shape[-1] == 49152 else 96
    tables = table(vocab, width, seed=vocab)
    rng = np.random.default_rng(k)
    approx = (rng.standard_normal(shape) * 3).astype(np.float32)
    hidden = rng.standard_normal((*shape[:-1], width)).astype(np.float32)
    out = run(approx, hidden, tables, k, threads)
    assert out.shape == approx.shape and out.dtype == np.float32
    expected = rescore_logits_ref(approx, hidden, *tables, k)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    changed = (out != approx).reshape(-1, vocab).sum(axis=1)
    assert (changed == min(k, vocab)).all()  # exactly k logits of each row rescored (random rows never match)


def test_rows_are_the_same_on_any_number_of_threads():
    """A batch's rows are rescored in parallel (one row a task): each row's bits are those of one thread."""
    tables = table(49152, 576, seed=3)
    rng = np.random.default_rng(3)
    approx = (rng.standard_normal((32, 49152)) * 3).astype(np.float32)
    hidden = rng.standard_normal((32, 576)).astype(np.float32)
    one = run(approx, hidden, tables, 256, threads=1)
    np.testing.assert_array_equal(run(approx, hidden, tables, 256, threads=4), one)
    np.testing.assert_array_equal(run(approx[7:8], hidden[7:8], tables, 256), one[7:8])


def test_ties_at_the_kth_value_and_non_finite_logits_follow_the_reference():
    """Many logits equal to the k-th value (the lower ids are rescored), NaN never chosen, -inf chosen only when
    fewer finite logits than k remain."""
    vocab, width, k = 3000, 64, 20  # more groups of 64 than k: the kernel's group-maxima path
    tables = table(vocab, width, seed=3)
    approx = np.zeros((3, vocab), dtype=np.float32)
    approx[0, ::7] = 1.0  # 429 ones: the top 20 are the 20 lowest ids among them
    approx[1, :] = np.nan
    approx[1, [5, 17, 250]] = [2.0, -np.inf, 0.5]  # three non-NaN values: all of them, fewer than k
    approx[2, :] = -np.inf
    approx[2, 100:110] = np.arange(10, dtype=np.float32)
    hidden = np.random.default_rng(4).standard_normal((3, width)).astype(np.float32)
    out = run(approx, hidden, tables, k)
    expected = rescore_logits_ref(approx, hidden, *tables, k)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert np.flatnonzero(out[0] != approx[0]).tolist() == list(range(0, 7 * k, 7))
    assert np.isnan(out[1]).sum() == vocab - 3


def test_bad_shapes_name_the_problem():
    tables = table(64, 64)
    approx, hidden = np.zeros((2, 64), np.float32), np.zeros((2, 64), np.float32)
    with pytest.raises(Exception, match=r"hidden must be \[\.\.\., D = 64\]"):
        run(approx, np.zeros((2, 32), np.float32), tables, 4)
    with pytest.raises(Exception, match="must share their leading dims"):
        run(approx, np.zeros((3, 64), np.float32), tables, 4)
    data, scales, zero_points = tables
    with pytest.raises(Exception, match=r"scales and zero_points must be \[V, D / 32\]"):
        run(approx, hidden, (data, scales[:, :1].copy(), zero_points), 4)
