"""kiln.MatMulGGUF with int8 activations: the spec's integers against the float decoding, and the ONNX Runtime CPU
kernel against the spec (within float32 summation-order bounds of its exact integer terms: a misplaced scale, minimum,
sub-block, 16-sum or a differently rounded activation is orders of magnitude past them), the same bits for a row at
every T and thread count, and the attribute's errors."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.gguf_blocks import FORMATS, GgmlType, block_integers, dequantize, random_blocks
from kiln.gguf_int8 import INT8_KINDS, block_terms, matmul_gguf_int8_ref, quantize_rows
from kiln.matmul_gguf import make_single_op_model, matmul_gguf_ref

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()
TYPES = sorted(INT8_KINDS)  # the int8-activation kernels (Q5_0 / Q5_1 keep float32 activations)


def session(model, threads: int = 2):
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_kernel(w, kind, x, bias=None, threads=2):
    model = make_single_op_model(w, kind, bias, rank=x.ndim, int8_activations=True)
    return session(model, threads).run(None, {"x": x})[0]


def blocks_for(kind, rows, blocks_per_row, seed=0):
    return random_blocks(np.random.default_rng(seed), kind, rows, blocks_per_row * FORMATS[kind].weights)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_block_integers_rebuild_the_decoded_weights(kind):
    """d * scale * q - dmin * min, in float64, is the float decoding (float32 rounding apart)."""
    w = blocks_for(kind, 5, 2, seed=1)
    ints = block_integers(w, kind)
    weights = ints.d[..., None, None] * ints.scales[..., None] * ints.q.astype(np.float64)
    if ints.mins is not None:
        assert ints.dmin is not None
        weights = weights - (ints.dmin[..., None] * ints.mins)[..., None]
    np.testing.assert_allclose(weights.reshape(5, -1), dequantize(w, kind), rtol=1e-6, atol=1e-7)


def test_activations_round_per_block_half_to_even():
    x = np.zeros((1, 512), np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -2.5]  # block 0: step exactly 1, halves to even
    x[0, 256:258] = [0.0, -3.0]  # block 1: step 3 / 127
    acts = quantize_rows(x, 256)
    assert acts.step[0, 0] == 1.0 and list(acts.q[0, :4]) == [127, 0, 2, -2]
    assert acts.q[0, 257] == -127 and acts.sums[0, 0] == 127 and acts.sums[0, 16] == -127
    assert quantize_rows(np.zeros((1, 32), np.float32), 32).step[0, 0] == 0


def test_the_int8_spec_stays_near_the_exact_product():
    """int8 activations cost ~1% of a dot's size on Gaussian x (no outliers): the spec is the weights' product."""
    rng = np.random.default_rng(2)
    for kind in TYPES:
        w = blocks_for(kind, 16, 1024 // FORMATS[kind].weights, seed=2)
        x = rng.standard_normal((3, 1024)).astype(np.float32)
        exact = matmul_gguf_ref(x, w, kind)
        err = np.abs(matmul_gguf_int8_ref(x, w, kind) - exact).max() / np.abs(exact).max()
        assert err < 0.03, kind.name


def _check(kind, x, w, bias=None, threads=2):
    y = run_kernel(w, kind, x, bias, threads)
    terms, magnitudes = block_terms(x.reshape(-1, x.shape[-1]), w, kind)
    extra = np.abs(bias.astype(np.float64)) if bias is not None else 0
    ref = terms.sum(-1) + (bias.astype(np.float64) if bias is not None else 0)
    # float32 sums (S of 32 values, the terms in 8 lanes, then the lanes) and the bias: ulps of the magnitudes
    bound = 4e-7 * (magnitudes.sum(-1) + extra) * (6 + np.log2(terms.shape[-1])) + 1e-30
    err = np.abs(y.reshape(ref.shape) - ref)
    assert (err <= bound).all(), f"{kind.name}: {float((err / bound).max()):.3g} of the bound"
    return y


# one row (decode), tiles of up to 4 rows and their remainders, items of 16 channels x 32 rows and ragged ones
@pytest.mark.parametrize("t, n, blocks", [(1, 1, 1), (1, 35, 3), (3, 17, 2), (5, 16, 1), (37, 33, 2), (70, 9, 1)])
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_kernel_matches_spec(kind, t, n, blocks):
    rng = np.random.default_rng(t * 100 + n)
    w = blocks_for(kind, n, blocks, seed=t + n)
    k = blocks * FORMATS[kind].weights
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, 5] *= 30  # an outlier channel: its block's step is coarse
    if t > 2:
        x[1] = 0  # an all-zero row: step 0
    bias = rng.standard_normal(n).astype(np.float32) if t % 2 else None
    y = _check(kind, x, w, bias)
    assert y.shape == (t, n)
    np.testing.assert_allclose(y, matmul_gguf_int8_ref(x, w, kind, bias), rtol=1e-4, atol=1e-4 * np.abs(y).max())


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_kernel_at_a_1b_shape_k(kind):
    """K = 2048 (a 1B model's hidden size): 8 k-quant blocks or 64 blocks of 32 a row."""
    rng = np.random.default_rng(11)
    w = blocks_for(kind, 24, 2048 // FORMATS[kind].weights, seed=11)
    _check(kind, rng.standard_normal((6, 2048)).astype(np.float32), w)


@pytest.mark.parametrize("kind", [GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K], ids=lambda t: t.name)
def test_kernel_past_the_8_row_tiles_k(kind):
    """K = 4352 (17 blocks of 256): past 4096 a k-quant tile holds 4 rows, not 8; 11 rows are 4 + 4 + 3."""
    rng = np.random.default_rng(12)
    w = blocks_for(kind, 6, 17, seed=12)
    x = rng.standard_normal((11, 17 * 256)).astype(np.float32)
    y = _check(kind, x, w)
    np.testing.assert_array_equal(y[9:10], run_kernel(w, kind, x[9:10]))


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_a_row_has_the_same_bits_at_every_t_every_thread_count_and_rank_3(kind):
    rng = np.random.default_rng(5)
    w = blocks_for(kind, 40, 512 // FORMATS[kind].weights, seed=5)
    x = rng.standard_normal((2, 9, 512)).astype(np.float32)
    batch = run_kernel(w, kind, x)
    assert batch.shape == (2, 9, 40)
    np.testing.assert_array_equal(batch[1, 4:5], run_kernel(w, kind, x[1, 4:5]))
    np.testing.assert_array_equal(batch, run_kernel(w, kind, x, threads=1))


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_every_row_of_a_batch_has_the_bits_of_the_row_alone(kind):
    """Decode (one row) against speculative verification (rows in tiles of 4 or 8, work items of 32 rows and their
    remainders): the same bits for every row, in any tile and at any place in it."""
    rng = np.random.default_rng(6)
    w = blocks_for(kind, 21, 512 // FORMATS[kind].weights, seed=6)
    x = rng.standard_normal((37, 512)).astype(np.float32)
    x[:, 3] *= 20
    s = session(make_single_op_model(w, kind, rng.standard_normal(21).astype(np.float32), rank=2,
                                     int8_activations=True))
    batch = s.run(None, {"x": x})[0]
    alone = np.concatenate([s.run(None, {"x": x[t:t + 1]})[0] for t in range(len(x))])
    np.testing.assert_array_equal(batch, alone)
    np.testing.assert_array_equal(s.run(None, {"x": x[5:16]})[0], batch[5:16])  # tiles starting off the batch's


@pytest.mark.parametrize("kind", [GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K], ids=lambda t: t.name)
def test_a_k_quant_batch_of_each_tile_edge_has_the_bits_of_its_rows_alone(kind):
    """T rows against each row alone for T at the k-quant tile's edges (tiles of 8 rows: 1, 2, 3, 5, 8, 9, 17) and
    an odd channel count past a 16-channel work item: the many-row tile runs each (channel, row) as the one-row
    tile does."""
    rng = np.random.default_rng(7)
    w = blocks_for(kind, 19, 2, seed=7)
    x = rng.standard_normal((17, 512)).astype(np.float32)
    s = session(make_single_op_model(w, kind, rank=2, int8_activations=True))
    alone = np.concatenate([s.run(None, {"x": x[t:t + 1]})[0] for t in range(len(x))])
    for t in (2, 3, 5, 8, 9, 17):
        np.testing.assert_array_equal(s.run(None, {"x": x[:t]})[0], alone[:t], err_msg=f"T = {t}")


def test_kernel_refuses_an_unknown_activation_mode():
    from onnx import helper

    w = blocks_for(GgmlType.Q4_K, 4, 1)
    model = make_single_op_model(w, GgmlType.Q4_K, int8_activations=True)
    model.graph.node[0].attribute[1].CopyFrom(helper.make_attribute("int8_activations", 2))
    with pytest.raises(Exception, match="int8_activations must be 0 .* or 1"):
        session(model).run(None, {"x": np.zeros((1, 256), np.float32)})


@pytest.mark.parametrize("kind", sorted(set(GgmlType) - INT8_KINDS), ids=lambda t: t.name)
def test_kernel_refuses_int8_activations_for_a_kind_without_an_int8_kernel(kind):
    model = make_single_op_model(blocks_for(kind, 4, 1), kind, int8_activations=True)
    with pytest.raises(Exception, match=f"int8_activations = 1 has no kernel for {kind.name}"):
        session(model).run(None, {"x": np.zeros((1, FORMATS[kind].weights), np.float32)})
