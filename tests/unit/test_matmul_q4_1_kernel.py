"""kiln.MatMulQ4_1: the numpy reference against fp32 x @ W.T, and the ONNX Runtime CPU kernel
(libkiln_ops.so) against the reference: odd and ragged shapes, bias, rank 3, errors on bad shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.matmul_q4_1 import (
    BLOCK,
    RECORDS,
    Q4_1Weights,
    make_single_op_model,
    matmul_q4_1_ref,
    quantize_activations,
)
from kiln.optimize.quant.rtn import quantize_q4_1

ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()


def session(model, threads: int = 2):
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def random_case(rng, t: int, k: int, n: int) -> tuple[np.ndarray, Q4_1Weights]:
    """Activations with an outlier channel and a zero block, and Q4_1 weights of random weights."""
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, 3] *= 20  # an outlier widens its block's int8 step
    if k > BLOCK:
        x[0, BLOCK:2 * BLOCK] = 0  # an all-zero block: step 0
    w = (rng.standard_normal((n, k)) * 0.05 - 0.01).astype(np.float32)
    return x, quantize_q4_1(w)


def scale_of(x: np.ndarray, w: Q4_1Weights) -> float:
    """|x| @ |W|.T: the size the float rounding of a sum of products is relative to."""
    return float((np.abs(x) @ np.abs(w.dequantize()).T).max())


@pytest.mark.parametrize("k", [96, 128])  # an odd and an even number of blocks
def test_pack_round_trips_in_the_documented_layout(k):
    rng = np.random.default_rng(0)
    w = quantize_q4_1(rng.standard_normal((3, k)).astype(np.float32))
    qs, dm = w.pack()
    assert qs.shape == (3, 2, 32) and qs.dtype == np.uint8 and dm.shape == (3, 2, k // 32) and dm.dtype == np.float16
    back = Q4_1Weights.unpack(qs, dm)
    np.testing.assert_array_equal(back.q, w.q)
    np.testing.assert_array_equal(back.d, w.d)
    np.testing.assert_array_equal(back.m, w.m)
    # byte i of pair j: element i of block 2j | element i of block 2j + 1 << 4
    assert qs[1, 0, 5] == w.q[1, 5] | (w.q[1, 32 + 5] << 4)
    assert qs[1, 1, 7] == w.q[1, 64 + 7] | ((w.q[1, 96 + 7] if k == 128 else 0) << 4)
    np.testing.assert_array_equal(dm[:, 0], w.d)


def test_reference_is_x_at_w_up_to_int8_activations():
    rng = np.random.default_rng(1)
    x, weights = random_case(rng, 5, 96, 7)
    w = weights.dequantize()
    exact = x.astype(np.float64) @ w.T
    y = matmul_q4_1_ref(x, *weights.pack())
    # int8 rounding (half a step per element) only meets the centred nibbles |q - 7.5| * d
    acts = quantize_activations(x)
    centred = np.abs(weights.q - 7.5) * np.repeat(weights.d.astype(np.float64), BLOCK, axis=1)
    bound = (np.repeat(acts.scale, BLOCK, axis=1) / 2) @ centred.T
    assert np.all(np.abs(y - exact) <= bound + 1e-5 * scale_of(x, weights))
    assert np.abs(y - exact).max() > 1e-6  # int8 activations do move the result
    np.testing.assert_array_equal(acts.q.reshape(5, 3, 32)[0, 1], 0)  # the zero block stays zero


# one row (decode), passes of up to 6 (AVX2) or 12 (VNNI) rows, work items of 32 rows; N a whole number of groups
# of 16 channels (960), a group and a ragged one (17, 33, 35), less than one (1, 3, 5, 6, 7, 9); nb = 1..48
@pytest.mark.parametrize("t, k, n", [(1, 32, 1), (1, 96, 7), (1, 576, 960), (3, 64, 17), (7, 96, 33), (37, 160, 5),
                                     (64, 1536, 66), (5, 288, 3), (2, 224, 9), (10, 608, 6), (1, 224, 6),
                                     (33, 576, 35), (16, 576, 35), (24, 96, 7)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_reference(t, k, n, threads):
    rng = np.random.default_rng(t * 1000 + n)
    x, w = random_case(rng, t, k, n)
    y = session(make_single_op_model(w), threads).run(None, {"x": x})[0]
    assert y.shape == (t, n)
    np.testing.assert_allclose(y, matmul_q4_1_ref(x, *w.pack()), rtol=0, atol=2e-6 * scale_of(x, w))


# the few-rows tiles (speculative verification): T = 2..13 covers one pass of 2..12 rows and two passes in either
# build; N = 35 leaves two groups of 16 channels and a ragged one, N = 7 only a ragged one
@pytest.mark.parametrize("t", range(2, 14))
@pytest.mark.parametrize("k, n", [(576, 35), (96, 7)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_reference_for_few_rows(t, k, n, threads):
    rng = np.random.default_rng(100 * t + n)
    x, w = random_case(rng, t, k, n)
    bias = rng.standard_normal(n).astype(np.float32)
    y = session(make_single_op_model(w, bias), threads).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, matmul_q4_1_ref(x, *w.pack(), bias), rtol=0, atol=2e-6 * scale_of(x, w))


# passes of up to 6 or 12 rows and their remainders, one work item of rows (32) and more
@pytest.mark.parametrize("t", [2, 3, 4, 5, 7, 8, 12, 13, 16, 17, 24, 25, 32, 33])
def test_each_row_is_bitwise_what_it_is_alone(t):
    """A row's outputs do not depend on the rows around it, in any path (decode, few rows, unpacked tiles):
    speculative verification of k guesses reproduces plain decoding's numbers exactly. Rows are distinct, so
    a tile that mixed up its rows would also fail here."""
    rng = np.random.default_rng(t)
    x, w = random_case(rng, t, 576, 35)
    bias = rng.standard_normal(35).astype(np.float32)
    sess = session(make_single_op_model(w, bias), threads=2)
    y = sess.run(None, {"x": x})[0]
    alone = np.concatenate([sess.run(None, {"x": x[i:i + 1]})[0] for i in range(t)])
    np.testing.assert_array_equal(y, alone)


def test_weights_that_are_graph_inputs_are_repacked_per_call():
    """Engines' weights are constants, repacked once at load; weights fed as inputs take the same kernel."""
    rng = np.random.default_rng(8)
    x, w = random_case(rng, 5, 96, 19)
    model = make_single_op_model(w)
    for name in ("qs", "dm"):
        init = next(i for i in model.graph.initializer if i.name == name)
        model.graph.initializer.remove(init)
        dtype = {"qs": TensorProto.UINT8, "dm": TensorProto.FLOAT16}[name]
        model.graph.input.append(helper.make_tensor_value_info(name, dtype, list(init.dims)))
    qs, dm = w.pack()
    y = session(model).run(None, {"x": x, "qs": qs, "dm": dm})[0]
    np.testing.assert_array_equal(y, session(make_single_op_model(w)).run(None, {"x": x})[0])


def test_kernel_bias_rank3_and_empty_input():
    rng = np.random.default_rng(5)
    x, w = random_case(rng, 6, 96, 9)
    bias = rng.standard_normal(9).astype(np.float32)
    sess = session(make_single_op_model(w, bias, rank=3))
    y = sess.run(None, {"x": x.reshape(2, 3, 96)})[0]
    np.testing.assert_allclose(y, matmul_q4_1_ref(x, *w.pack(), bias).reshape(2, 3, 9), rtol=0,
                               atol=2e-6 * scale_of(x, w))
    assert sess.run(None, {"x": np.zeros((2, 0, 96), np.float32)})[0].shape == (2, 0, 9)


def test_kernel_rejects_mismatched_k():
    rng = np.random.default_rng(6)
    _, w = random_case(rng, 1, 64, 4)
    model = make_single_op_model(w)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "K"  # let the wrong K reach the kernel
    with pytest.raises(Exception, match=r"kiln.MatMulQ4_1: x must be \[..., K = 64\]"):
        session(model).run(None, {"x": np.zeros((2, 96), np.float32)})


@pytest.mark.parametrize("t", [1, 6])  # the decode tiles and the row tiles
def test_partial_block_group_ignores_the_next_channels_numbers(t):
    """With nb = 9 the last group of 8 blocks holds one: its other lanes read the next channel's d, which the
    kernel must drop, not multiply by the zero padding (an inf there would turn channel 0 into nan)."""
    rng = np.random.default_rng(7)
    x, w = random_case(rng, t, 288, 3)
    qs, dm = w.pack()
    dm = dm.copy()
    dm[1, 0, 0] = np.inf  # channel 1's first step
    model = make_single_op_model(w)
    for init in model.graph.initializer:
        if init.name == "dm":
            init.CopyFrom(numpy_helper.from_array(dm, "dm"))
    y = session(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(y[:, [0, 2]], matmul_q4_1_ref(x, qs[[0, 2]], dm[[0, 2]]), rtol=0,
                               atol=2e-6 * scale_of(x, w))
    assert not np.isfinite(y[:, 1]).any()


def test_a_matrix_packed_on_several_threads_matches_the_reference():
    """A load packs a constant matrix of 16 MiB or more of records on one thread per core, into huge pages: 417
    groups of 16 channels (the last ragged) of 128 blocks are 17 MiB, split between the threads mid-matrix."""
    rng = np.random.default_rng(9)
    x, w = random_case(rng, 2, 4096, 16 * 416 + 5)
    y = session(make_single_op_model(w)).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, matmul_q4_1_ref(x, *w.pack()), rtol=0, atol=2e-6 * scale_of(x, w))


# ---- the records layout: what an engine stores, read by the kernel where it lies

@pytest.mark.parametrize("n, k", [(1, 32), (16, 64), (17, 96), (35, 576), (48, 288)])
def test_records_round_trip_in_the_documented_layout(n, k):
    rng = np.random.default_rng(n + k)
    w = quantize_q4_1(rng.standard_normal((n, k)).astype(np.float32))
    qs, dm = w.pack_records()
    groups, nb = -(-n // 16), k // BLOCK
    assert qs.shape == (groups, nb, 320) and qs.dtype == np.uint8 and dm.shape == (n, 0) and dm.dtype == np.float16
    back = Q4_1Weights.unpack_records(qs, dm)
    for name in ("q", "d", "m"):
        np.testing.assert_array_equal(getattr(back, name), getattr(w, name))
    # record (g, b), chunk j, lane l, byte i: input 32b + 8j + i low, 32b + 8j + 4 + i high; then 16 d, 16 m
    g, lane, b, j, i = groups - 1, (n - 1) % 16, nb - 1, 3, 2
    c = 16 * g + lane
    assert qs[g, b, 64 * j + 4 * lane + i] == w.q[c, 32 * b + 8 * j + i] | (w.q[c, 32 * b + 8 * j + 4 + i] << 4)
    assert qs[g, b, 256 + 2 * lane:258 + 2 * lane].tobytes() == w.d[c, b].astype("<f2").tobytes()
    assert qs[g, b, 288 + 2 * lane:290 + 2 * lane].tobytes() == w.m[c, b].astype("<f2").tobytes()
    if n % 16:  # the ragged group's missing channels are zero bytes
        lanes = qs[-1, :, :256].reshape(nb, 4, 16, 4)[:, :, n % 16:]
        assert not lanes.any() and not qs[-1, :, 256:].view("<u2").reshape(nb, 2, 16)[:, :, n % 16:].any()


def test_records_are_refused_in_a_wrong_shape():
    w = quantize_q4_1(np.random.default_rng(0).standard_normal((17, 64)).astype(np.float32))
    qs, dm = w.pack_records()
    with pytest.raises(ValueError, match=r"qs must be uint8 \[2, nb, 320\] records for N = 17"):
        Q4_1Weights.unpack_records(qs[:1], dm)
    with pytest.raises(ValueError, match=r"dm must be float16 \[N, 0\]"):
        Q4_1Weights.unpack_records(qs, np.zeros((17, 2, 2), np.float16))
    with pytest.raises(ValueError, match="layout must be one of"):
        matmul_q4_1_ref(np.zeros((1, 64), np.float32), qs, dm, layout="rows")


def test_reference_on_records_is_the_reference_on_blocks():
    rng = np.random.default_rng(3)
    x, w = random_case(rng, 4, 160, 21)
    np.testing.assert_array_equal(matmul_q4_1_ref(x, *w.pack_records(), layout=RECORDS), matmul_q4_1_ref(x, *w.pack()))


# T = 1 (decode), 13 and 40 (more than one pass, more than one work item); N = 7 and 35 ragged, 48 whole groups
@pytest.mark.parametrize("t, k, n", [(1, 96, 7), (1, 576, 35), (13, 288, 48), (40, 608, 35), (5, 32, 1),
                                     (2, 4096, 16 * 416 + 5)])
def test_kernel_on_records_is_bitwise_the_kernel_on_blocks(t, k, n):
    """The kernel reading an engine's records computes the bits it computes from blocks it packs itself at load:
    numpy's packing is the kernel's, byte for byte (a d/m swap, a lane or a nibble out of place would differ)."""
    rng = np.random.default_rng(t + k + n)
    x, w = random_case(rng, t, k, n)
    bias = rng.standard_normal(n).astype(np.float32)
    blocks = session(make_single_op_model(w, bias)).run(None, {"x": x})[0]
    records = session(make_single_op_model(w, bias, layout=RECORDS)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(records, blocks)
    np.testing.assert_allclose(records, matmul_q4_1_ref(x, *w.pack_records(), bias, layout=RECORDS), rtol=0,
                               atol=2e-6 * scale_of(x, w))


def test_records_that_are_graph_inputs_are_read_as_given():
    rng = np.random.default_rng(11)
    x, w = random_case(rng, 3, 96, 19)
    model = make_single_op_model(w, layout=RECORDS)
    init = next(i for i in model.graph.initializer if i.name == "qs")
    model.graph.initializer.remove(init)
    model.graph.input.append(helper.make_tensor_value_info("qs", TensorProto.UINT8, ["G", "nb", "R"]))
    qs, _ = w.pack_records()
    y = session(model).run(None, {"x": x, "qs": qs})[0]
    np.testing.assert_array_equal(y, session(make_single_op_model(w)).run(None, {"x": x})[0])
    with pytest.raises(Exception, match=r"kiln.MatMulQ4_1: qs must be uint8 records \[ceil\(N / 16\) = 2, nb, 320\]"):
        session(model).run(None, {"x": x, "qs": qs[:, :, :256].copy()})


def test_kernel_names_a_wrong_layout_or_records_shape():
    rng = np.random.default_rng(12)
    x, w = random_case(rng, 2, 64, 5)
    model = make_single_op_model(w, layout=RECORDS)
    model.graph.node[0].attribute[0].s = b"rows"
    with pytest.raises(Exception, match=r"kiln.MatMulQ4_1: layout must be \"blocks\" or \"records\", got \"rows\""):
        session(model)
    model = make_single_op_model(w)  # blocks' dm under the records layout
    model.graph.node[0].attribute.append(helper.make_attribute("layout", RECORDS))
    with pytest.raises(Exception, match=r"kiln.MatMulQ4_1: dm must be float16 \[N, 0\] with layout \"records\""):
        session(model).run(None, {"x": x})


def q4_0_case(rng, t: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, Q4_1Weights]:
    """Activations, random Q4_0 rows (llama.cpp's bytes: d float16, 16 bytes of nibbles per block of 32) and the same
    weights as Q4_1 codes (minimum -8 d)."""
    from kiln.optimize.quantize_gguf import q4_0_as_q4_1

    x, _ = random_case(rng, t, k, 1)
    blocks = np.zeros((n, k // BLOCK, 18), np.uint8)
    blocks[..., :2] = (rng.uniform(0.002, 0.02, (n, k // BLOCK)).astype(np.float16)[..., None]).view(np.uint8)
    blocks[..., 2:] = rng.integers(0, 256, (n, k // BLOCK, 16), dtype=np.uint8)
    codes = q4_0_as_q4_1(blocks.reshape(n, -1))
    assert codes is not None
    return x, blocks.reshape(n, -1), codes


def test_reference_centred_at_8_is_llama_cpps_q4_0_arithmetic_on_q4_0_blocks():
    from kiln.gguf_blocks import GgmlType
    from kiln.gguf_int8 import matmul_gguf_int8_ref
    from kiln.matmul_q4_1 import Q4_0_CENTRE

    rng = np.random.default_rng(20)
    x, blocks, codes = q4_0_case(rng, 6, 160, 9)
    q4_0 = matmul_gguf_int8_ref(x, blocks, GgmlType.Q4_0)  # d * xs * ((q - 8) . xq) a block
    tight = 1e-6 * scale_of(x, codes)
    np.testing.assert_allclose(matmul_q4_1_ref(x, *codes.pack(), centre=Q4_0_CENTRE), q4_0, rtol=0, atol=tight)
    # the nibbles' mean leaves 0.5 * d * E of each block's rounding in the sum
    assert np.abs(matmul_q4_1_ref(x, *codes.pack()) - q4_0).max() > 100 * tight


@pytest.mark.parametrize("t, k, n", [(1, 576, 35), (5, 96, 7), (37, 160, 33)])
@pytest.mark.parametrize("layout", ["blocks", RECORDS])
def test_kernel_takes_the_nodes_centre(t, k, n, layout):
    from kiln.matmul_q4_1 import Q4_0_CENTRE

    rng = np.random.default_rng(t + n)
    x, _, codes = q4_0_case(rng, t, k, n)
    y = session(make_single_op_model(codes, layout=layout, centre=Q4_0_CENTRE)).run(None, {"x": x})[0]
    tolerance = 2e-6 * scale_of(x, codes)
    np.testing.assert_allclose(y, matmul_q4_1_ref(x, *codes.pack(), centre=Q4_0_CENTRE), rtol=0, atol=tolerance)
    assert np.abs(y - matmul_q4_1_ref(x, *codes.pack())).max() > 10 * tolerance  # not the default's numbers
    default = session(make_single_op_model(codes, layout=layout)).run(None, {"x": x})[0]
    np.testing.assert_allclose(default, matmul_q4_1_ref(x, *codes.pack()), rtol=0, atol=tolerance)


def test_kernel_refuses_a_centre_outside_the_codes():
    rng = np.random.default_rng(21)
    _, w = random_case(rng, 2, 64, 5)
    with pytest.raises(Exception, match=r"kiln.MatMulQ4_1: centre must be a code in \[0, 15\].*got 16"):
        session(make_single_op_model(w, centre=16.0))
    with pytest.raises(ValueError, match=r"centre must be a code in \[0, 15\]"):
        matmul_q4_1_ref(np.zeros((1, 64), np.float32), *w.pack(), centre=-1.0)
