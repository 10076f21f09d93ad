"""kiln.MatMulGGUF: the spec's block decoding against gguf-py and against the documented layouts (a flipped bit
changes exactly the weights it should), and the ONNX Runtime CPU kernel against the spec: exactly the decoded weights
under an identity x, within float32 rounding of x @ W^T otherwise, the same bits for a row at every T, errors."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.gguf_blocks import FORMATS, GgmlType, dequantize, random_blocks, row_bytes
from kiln.matmul_gguf import make_single_op_model, matmul_gguf_ref

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()
TYPES = list(GgmlType)


def session(model, threads: int = 2):
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_kernel(w, kind, x, bias=None):
    return session(make_single_op_model(w, kind, bias, rank=x.ndim)).run(None, {"x": x})[0]


def blocks_for(kind, rows, blocks_per_row, seed=0):
    return random_blocks(np.random.default_rng(seed), kind, rows, blocks_per_row * FORMATS[kind].weights)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_spec_decodes_as_gguf_py_bit_for_bit(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = blocks_for(kind, 7, 3)
    ours = dequantize(w, kind)
    theirs = gguf_dequantize(w, GGMLQuantizationType(int(kind))).reshape(ours.shape)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.isfinite(ours).all() and ours.std() > 0.01


def _changed(kind, byte: int, bit: int) -> set[int]:
    """The weights of one block whose value moves when `bit` of `byte` flips."""
    w = blocks_for(kind, 1, 1, seed=byte)
    before = dequantize(w, kind)[0]
    w[0, byte] ^= np.uint8(1 << bit)
    return set(np.flatnonzero(dequantize(w, kind)[0] != before).tolist())


def _span(start: int, count: int) -> set[int]:
    return set(range(start, start + count))


# (type, byte, bit) -> the weights that byte's bit feeds, from the layouts in kiln/gguf_blocks.py. A bit can leave a
# weight unchanged when its other factor is 0 (a 0 nibble under a scale bit), so expectations are supersets checked
# for inclusion, and the flipped nibble bits' single weights checked exactly.
LAYOUT = [
    (GgmlType.Q8_0, 2 + 5, 0, {5}),
    (GgmlType.Q4_0, 2 + 3, 0, {3}), (GgmlType.Q4_0, 2 + 3, 4, {16 + 3}),
    (GgmlType.Q5_0, 6 + 3, 0, {3}), (GgmlType.Q5_0, 6 + 3, 4, {16 + 3}),
    (GgmlType.Q5_0, 2 + 1, 2, {8 + 2}), (GgmlType.Q5_0, 2 + 3, 1, {24 + 1}),  # fifth bits: bit i of the word
    (GgmlType.Q5_1, 8 + 0, 4, {16}), (GgmlType.Q5_1, 4 + 2, 5, {16 + 5}),
    (GgmlType.Q5_1, 2 + 1, 3, _span(0, 32)),         # the minimum m
    (GgmlType.Q4_K, 16 + 32 * 2 + 7, 0, {64 * 2 + 7}), (GgmlType.Q4_K, 16 + 32 * 2 + 7, 4, {64 * 2 + 32 + 7}),
    (GgmlType.Q4_K, 4 + 1, 0, _span(32, 32)),        # scale of sub-block 1
    (GgmlType.Q4_K, 4 + 1, 6, _span(32 * 5, 32)),    # top bits of sub-block 5's scale
    (GgmlType.Q4_K, 8 + 2, 0, _span(64, 32)),        # minimum of sub-block 2
    (GgmlType.Q4_K, 8 + 2, 7, _span(32 * 6, 32)),    # top bits of sub-block 6's minimum
    (GgmlType.Q4_K, 12 + 3, 1, _span(32 * 7, 32)),   # low bits of sub-block 7's scale
    (GgmlType.Q4_K, 12 + 3, 5, _span(32 * 7, 32)),   # low bits of sub-block 7's minimum
    (GgmlType.Q5_K, 16 + 9, 3, {32 * 3 + 9}),        # fifth bit: bit j of byte l is weight l of sub-block j
    (GgmlType.Q5_K, 48 + 32 * 1 + 4, 4, {64 * 1 + 32 + 4}),
    (GgmlType.Q5_K, 4 + 0, 0, _span(0, 32)),
    (GgmlType.Q6_K, 64 * 1 + 32 * 1 + 5, 0, {128 + 32 + 5}),       # ql low nibble: group t = 1 of half 1
    (GgmlType.Q6_K, 64 * 1 + 32 * 1 + 5, 4, {128 + 32 * 3 + 5}),   # ql high nibble: group t = 3
    (GgmlType.Q6_K, 128 + 32 * 0 + 9, 4, {32 * 2 + 9}),            # qh bits 4-5: group t = 2 of half 0
    (GgmlType.Q6_K, 192 + 11, 0, _span(16 * 11, 16)),               # the scale of weights 176..191
]


@pytest.mark.parametrize("kind, byte, bit, expected", LAYOUT, ids=lambda v: getattr(v, "name", str(v)))
def test_a_flipped_bit_moves_the_weights_its_layout_says(kind, byte, bit, expected):
    changed = _changed(kind, byte, bit)
    assert changed and changed <= expected
    if len(expected) == 1:
        assert changed == expected


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_kernel_under_identity_x_gives_the_decoded_weights_exactly(kind):
    """y = I @ W^T is W^T: each output one product with 1.0, so the kernel's scale and minimum arithmetic must be the
    spec's exactly, in every place (a misplaced scale, minimum or sub-block shows as a wrong weight)."""
    w = blocks_for(kind, 9, 2, seed=3)
    k = dequantize(w, kind).shape[1]
    y = run_kernel(w, kind, np.eye(k, dtype=np.float32))
    np.testing.assert_array_equal(y.T, dequantize(w, kind))  # values (a zero's sign aside): bit for bit


def _scale(x, w, kind) -> float:
    return float((np.abs(x) @ np.abs(dequantize(w, kind)).T).max())


# one row (decode), tiles of up to 4 rows and their remainders, items of 16 channels x 32 rows and ragged ones
@pytest.mark.parametrize("t, n, blocks", [(1, 1, 1), (1, 35, 3), (3, 17, 2), (5, 16, 1), (37, 33, 2), (70, 9, 1)])
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_kernel_matches_spec(kind, t, n, blocks):
    rng = np.random.default_rng(t * 100 + n)
    w = blocks_for(kind, n, blocks, seed=t + n)
    k = blocks * FORMATS[kind].weights
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, 5] *= 30  # an outlier channel
    bias = rng.standard_normal(n).astype(np.float32) if t % 2 else None
    y = run_kernel(w, kind, x, bias)
    ref = matmul_gguf_ref(x, w, kind, bias)
    assert y.shape == (t, n)
    assert np.abs(y - ref).max() <= 1e-5 * _scale(x, w, kind)


@pytest.mark.parametrize("kind", [GgmlType.Q4_K, GgmlType.Q6_K], ids=lambda t: t.name)
def test_a_row_has_the_same_bits_at_every_t_and_rank_3(kind):
    rng = np.random.default_rng(5)
    w = blocks_for(kind, 40, 2, seed=5)
    x = rng.standard_normal((2, 9, 512)).astype(np.float32)
    batch = run_kernel(w, kind, x)
    assert batch.shape == (2, 9, 40)
    alone = run_kernel(w, kind, x[1, 4:5])
    np.testing.assert_array_equal(batch[1, 4:5], alone)


def test_thread_counts_agree():
    w = blocks_for(GgmlType.Q4_K, 64, 2, seed=8)
    x = np.random.default_rng(8).standard_normal((3, 512)).astype(np.float32)
    model = make_single_op_model(w, GgmlType.Q4_K)
    one, two = (session(model, threads).run(None, {"x": x})[0] for threads in (1, 2))
    np.testing.assert_array_equal(one, two)


def test_kernel_refuses_bad_shapes_and_types():
    from onnx import helper, numpy_helper

    w = blocks_for(GgmlType.Q8_0, 4, 2)
    model = make_single_op_model(w, GgmlType.Q8_0)
    model.graph.input[0].type.tensor_type.shape.dim[-1].dim_param = "K"  # the kernel's check, not ONNX Runtime's
    with pytest.raises(Exception, match=r"x must be \[\.\.\., K = 64\]"):
        session(model).run(None, {"x": np.zeros((1, 32), np.float32)})
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w[:, :50]), "w"))
    with pytest.raises(Exception, match=r"w must be uint8 \[N, whole Q8_0 blocks of 34 bytes\]"):
        session(model).run(None, {"x": np.zeros((1, 64), np.float32)})
    model = make_single_op_model(w, GgmlType.Q8_0)
    model.graph.node[0].attribute[0].CopyFrom(helper.make_attribute("ggml_type", 3))  # Q4_1: no kernel here
    with pytest.raises(Exception, match="ggml_type 3 has no kernel"):
        session(model).run(None, {"x": np.zeros((1, 64), np.float32)})


def test_spec_refuses_what_is_not_whole_blocks():
    with pytest.raises(ValueError, match="whole blocks of 256 weights"):
        row_bytes(GgmlType.Q4_K, 576)
    with pytest.raises(ValueError, match="no kiln.MatMulGGUF kernel"):
        matmul_gguf_ref(np.zeros((1, 32), np.float32), np.zeros((1, 18), np.uint8), 3)
