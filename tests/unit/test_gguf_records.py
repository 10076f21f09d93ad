"""kiln.MatMulGGUF's Q4_K, Q5_K, Q6_K and Q8_0 records (layout "records", kiln/gguf_records.py): the layouts hold the
file's bytes (packed and unpacked bit for bit, each number at the byte the layout names), the specs stay near the
exact product of the file's weights, and the ONNX Runtime kernel matches them within float32 summation bounds (a
misplaced scale, minimum, step, high bit or block is orders of magnitude past them), with a row's bits the same at
every T and thread count; the build's pass packs only what the kernel takes, and the op names what it refuses."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from kiln.contract import OP_DOMAIN
from kiln.gguf_blocks import GgmlType, dequantize, k_scales_mins, random_blocks
from kiln.gguf_int8 import matmul_gguf_int8_ref
from kiln.gguf_records import (
    DMIN,
    MINS,
    Q5_HIGH,
    Q5_RECORD_BYTES,
    Q5_SCALES,
    Q6_D,
    Q6_HIGH,
    Q6_RECORD_BYTES,
    Q6_SCALES,
    Q8_D,
    Q8_RECORD_BYTES,
    RECORD_BYTES,
    SCALES,
    D,
    can_pack,
    matmul_q4_k_records_ref,
    matmul_q6_k_records_ref,
    matmul_records_ref,
    pack_q4_k_records,
    pack_q5_k_records,
    pack_q6_k_records,
    pack_q8_0_records,
    pack_records,
    unpack_q4_k_records,
    unpack_records,
)
from kiln.matmul_gguf import make_single_op_model, matmul_gguf_ref
from kiln.matmul_q4_1 import quantize_activations

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()
Q4_K, Q5_K, Q6_K, Q8_0 = GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K, GgmlType.Q8_0
KINDS = [Q4_K, Q5_K, Q6_K, Q8_0]


def blocks_of(kind, rows: int, superblocks: int, seed: int = 0) -> np.ndarray:
    return random_blocks(np.random.default_rng(seed), kind, rows, 256 * superblocks)


def q4_k(rows: int, superblocks: int, seed: int = 0) -> np.ndarray:
    return blocks_of(Q4_K, rows, superblocks, seed)


def session(model, threads: int = 2):
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_kernel(w, x, bias=None, threads=2, kind=Q4_K):
    model = make_single_op_model(w, kind, bias, rank=x.ndim, int8_activations=True, layout="records")
    return session(model, threads).run(None, {"x": x})[0]


@pytest.mark.parametrize("kind, nbytes", [(Q4_K, 2368), (Q5_K, 2880), (Q6_K, 3392), (Q8_0, 4352)],
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows, superblocks", [(16, 1), (48, 3), (32, 8)])
def test_records_hold_the_files_bytes(kind, nbytes, rows, superblocks):
    w = blocks_of(kind, rows, superblocks, seed=rows)
    records = pack_records(w, kind)
    assert records.shape == (rows // 16, superblocks, nbytes)
    assert nbytes in (RECORD_BYTES, Q5_RECORD_BYTES, Q6_RECORD_BYTES, Q8_RECORD_BYTES)
    np.testing.assert_array_equal(unpack_records(records, kind), w)


def test_each_number_sits_where_the_layout_says():
    """Channel 21 (group 1, lane 5), superblock 1: its d, dmin, the 6-bit scale and minimum of block 6 (packed in
    the 12 bytes' high fields) and the codes of inputs 256 + 32 * 6 + 8 * 2 + 1 (low nibble) and + 4 (high)."""
    w = q4_k(32, 2, seed=3)
    b = w.reshape(32, 2, 144)[21, 1]
    records = pack_q4_k_records(w)
    rec, lane = records[1, 1], 5
    assert rec[D + 2 * lane:D + 2 * lane + 2].tobytes() == b[0:2].tobytes()
    assert rec[DMIN + 2 * lane:DMIN + 2 * lane + 2].tobytes() == b[2:4].tobytes()
    sc, mn = k_scales_mins(b[None, 4:16])
    assert rec[SCALES + 16 * 6 + lane] == sc[0, 6] and rec[MINS + 16 * 6 + lane] == mn[0, 6]
    codes = np.concatenate([b[16:144].reshape(4, 32) & 15, b[16:144].reshape(4, 32) >> 4], axis=1)  # [chunk, 64]
    code = codes.reshape(4, 2, 32)[3, 0]  # block 6 = chunk 3's low nibbles
    byte = rec[256 * 6 + 64 * 2 + 4 * lane + 1]
    assert byte & 15 == code[8 * 2 + 1] and byte >> 4 == code[8 * 2 + 4 + 1]


def test_each_q6_k_number_sits_where_the_layout_says():
    """Channel 21 (group 1, lane 5), superblock 1: its d, the int8 scale of group 13 (block 6, second half) and the
    code of input 256 + 32 * 6 + 16 + 8 + 2: low nibble in chunk 3's byte 2 (low half), high 2 bits at bits 4-5 of
    the block's second high chunk."""
    from kiln.gguf_blocks import q6_k_integers

    w = blocks_of(Q6_K, 32, 2, seed=5)
    b = w.reshape(32, 2, 210)[21, 1]
    rec, lane = pack_q6_k_records(w)[1, 1], 5
    assert rec[Q6_D + 2 * lane:Q6_D + 2 * lane + 2].tobytes() == b[208:210].tobytes()
    assert rec[Q6_SCALES + 16 * 13 + lane].view(np.int8) == b[192 + 13].view(np.int8)
    code = int(q6_k_integers(b[None])[0, 32 * 6 + 16 + 8 + 2])
    assert rec[256 * 6 + 64 * 3 + 4 * lane + 2] & 15 == code & 15
    assert (rec[Q6_HIGH + 128 * 6 + 64 + 4 * lane + 2] >> 4) & 3 == code >> 4
    assert not rec[Q6_D + 32:].any()  # the padding


def test_each_q5_k_number_sits_where_the_layout_says():
    """Q4_K's record around a chunk of fifth bits a block: byte 2048 + 64 s + 4 l + i holds at bit 2j the fifth bit of
    input 32 s + 8 j + i and at bit 2j + 1 that of input 32 s + 8 j + 4 + i; the nibbles, scales, minimums and steps
    are Q4_K's record of the same numbers, shifted past them."""
    from kiln.gguf_blocks import block_integers

    w = blocks_of(Q5_K, 32, 2, seed=12)
    records = pack_q5_k_records(w)
    assert records.shape == (2, 2, Q5_RECORD_BYTES) == (2, 2, 2880)
    codes = block_integers(w, Q5_K).q.astype(np.int64)  # [N, superblock, s, 32], 0..31
    for g, sb, s, j, lane, i in [(0, 0, 0, 0, 0, 0), (1, 1, 7, 3, 15, 3), (0, 1, 2, 1, 9, 2), (1, 0, 5, 2, 4, 1)]:
        byte = int(records[g, sb, Q5_HIGH + 64 * s + 4 * lane + i])
        channel = 16 * g + lane
        assert (byte >> (2 * j)) & 1 == codes[channel, sb, s, 8 * j + i] >> 4
        assert (byte >> (2 * j + 1)) & 1 == codes[channel, sb, s, 8 * j + 4 + i] >> 4
        nibbles = int(records[g, sb, 256 * s + 64 * j + 4 * lane + i])
        assert nibbles & 15 == codes[channel, sb, s, 8 * j + i] & 15
        assert nibbles >> 4 == codes[channel, sb, s, 8 * j + 4 + i] & 15
    q4_k = np.concatenate([w.reshape(32, 2, 176)[..., :16], w.reshape(32, 2, 176)[..., 48:]], axis=2).reshape(32, -1)
    np.testing.assert_array_equal(records[..., Q5_SCALES:], pack_q4_k_records(q4_k)[..., SCALES:])


def test_the_q5_k_spec_is_q4_k_s_formula_with_5_bit_codes():
    """Q5_K's records spec stays nearer the file's exact product than the blocks path's int8 (activations per 32
    against Q8_K's 256), and a code's fifth bit is worth 16 of its step."""
    rng = np.random.default_rng(13)
    w = blocks_of(Q5_K, 32, 3, seed=13)
    x = rng.standard_normal((6, 768)).astype(np.float32)
    exact = matmul_gguf_ref(x, w, Q5_K)
    spec = matmul_records_ref(x, pack_q5_k_records(w), Q5_K)
    assert np.abs(spec - exact).mean() < np.abs(matmul_gguf_int8_ref(x, w, Q5_K) - exact).mean()
    assert np.abs(spec - exact).max() < 0.02 * np.abs(exact).max()
    cleared = w.reshape(32, 3, 176).copy()
    cleared[..., 16:48] = 0  # no fifth bits
    without = matmul_records_ref(x, pack_q5_k_records(cleared.reshape(32, -1)), Q5_K)
    assert np.abs(without - spec).max() > 0.1 * np.abs(exact).max()


def test_each_q8_0_number_sits_where_the_layout_says():
    """Byte 512 s + 64 j + 4 l + i: channel l's code for input 32 s + 4 j + i plus 128; d of block s at 4096 + 32 s +
    2 l."""
    w = blocks_of(Q8_0, 32, 2, seed=9)
    records = pack_q8_0_records(w)
    assert records.shape == (2, 2, Q8_RECORD_BYTES) == (2, 2, 4352)
    blocks = w.reshape(32, 16, 34)  # 16 blocks of 32 a row
    codes = blocks[..., 2:].view(np.int8).astype(np.int64)
    for g, sb, s, j, lane, i in [(0, 0, 0, 0, 0, 0), (1, 1, 7, 7, 15, 3), (0, 1, 3, 5, 9, 2), (1, 0, 6, 1, 4, 1)]:
        channel, block = 16 * g + lane, 8 * sb + s
        assert records[g, sb, 512 * s + 64 * j + 4 * lane + i] == codes[channel, block, 4 * j + i] + 128
        at = Q8_D + 32 * s + 2 * lane
        assert records[g, sb, at:at + 2].tobytes() == blocks[channel, block, :2].tobytes()


def test_the_q8_0_spec_is_the_blocks_int8_path():
    """Q8_0's records compute what its blocks' int8 path computes (activations per 32 in both), to float rounding."""
    rng = np.random.default_rng(10)
    w = blocks_of(Q8_0, 32, 3, seed=10)
    x = rng.standard_normal((5, 768)).astype(np.float32)
    x[:, 9] *= 25
    spec = matmul_records_ref(x, pack_q8_0_records(w), Q8_0)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(dequantize(w, Q8_0)).T
    assert (np.abs(spec - matmul_gguf_int8_ref(x, w, Q8_0)) <= 1e-6 * magnitude).all()
    assert not can_pack(Q8_0, True, 16, 96) and can_pack(Q8_0, True, 16, 512)  # whole superblocks only
    with pytest.raises(ValueError, match="K a multiple of 256"):
        pack_q8_0_records(random_blocks(np.random.default_rng(0), Q8_0, 16, 96))


def test_packing_refuses_what_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="N a multiple of 16"):
        pack_q4_k_records(q4_k(24, 1))
    with pytest.raises(ValueError, match="2368"):
        unpack_q4_k_records(np.zeros((1, 1, 2000), np.uint8))


def test_the_spec_is_the_q4_1_formula_on_the_files_numbers():
    """Per block of 32: D xs (q . xq) + 7.5 D E - M S with D = d sc_j, M = dmin m_j; near the exact product, and
    nearer than the blocks layout's int8 path (activations per 256), on Gaussian x with an outlier channel."""
    rng = np.random.default_rng(4)
    w = q4_k(32, 4, seed=4)
    x = rng.standard_normal((6, 1024)).astype(np.float32)
    x[:, 7] *= 25
    exact = matmul_gguf_ref(x, w, Q4_K)
    spec = matmul_q4_k_records_ref(x, pack_q4_k_records(w))
    err = np.abs(spec - exact).max() / np.abs(exact).max()
    assert err < 0.02
    assert np.abs(spec - exact).mean() < np.abs(matmul_gguf_int8_ref(x, w, Q4_K) - exact).mean()
    # the formula by hand on one (row, channel)
    acts = quantize_activations(x[2:3])
    wf = dequantize(w, Q4_K).astype(np.float64)
    from kiln.gguf_blocks import block_integers
    ints = block_integers(w, Q4_K)
    steps = (ints.d[..., None] * ints.scales.astype(np.float32)).astype(np.float32).reshape(32, -1)[9]
    mins = (ints.dmin[..., None] * ints.mins.astype(np.float32)).astype(np.float32).reshape(32, -1)[9]
    q = ints.q.reshape(32, -1, 32)[9].astype(np.int64)
    dots = (acts.q.reshape(-1, 32).astype(np.int64) * q).sum(-1)
    by_hand = (steps * acts.scale[0] * dots + 7.5 * steps * acts.sum_errors[0] - mins * acts.sums[0]).sum()
    assert abs(by_hand - spec[2, 9]) <= 1e-6 * np.abs(x[2].astype(np.float64) @ np.abs(wf[9]))


def test_the_q6_k_spec_is_the_offset_codes_on_the_files_numbers():
    """Per group of 16: D xs ((q - 32) . xq) with D = d sc_g and xs the block of 32's step; near the exact product."""
    rng = np.random.default_rng(8)
    w = blocks_of(Q6_K, 32, 4, seed=8)
    x = rng.standard_normal((5, 1024)).astype(np.float32)
    x[:, 40] *= 25
    exact = matmul_gguf_ref(x, w, Q6_K)
    spec = matmul_q6_k_records_ref(x, pack_q6_k_records(w))
    assert np.abs(spec - exact).max() / np.abs(exact).max() < 0.02
    assert np.abs(spec - exact).mean() < np.abs(matmul_gguf_int8_ref(x, w, Q6_K) - exact).mean() * 1.5
    from kiln.gguf_blocks import block_integers
    ints = block_integers(w, Q6_K)
    acts = quantize_activations(x[1:2])
    steps = (ints.d[..., None] * ints.scales.astype(np.float32)).astype(np.float32).reshape(32, -1)[7]
    dots = (acts.q.reshape(-1, 16).astype(np.int64) * ints.q.reshape(32, -1, 16)[7].astype(np.int64)).sum(-1)
    by_hand = (steps * np.repeat(acts.scale[0], 2) * dots).sum()
    assert abs(by_hand - spec[1, 7]) <= 1e-6 * np.abs(x[1].astype(np.float64) @ np.abs(dequantize(w, Q6_K)[7]))


def _check(w, x, bias=None, threads=2, kind=Q4_K):
    y = run_kernel(w, x, bias, threads, kind)
    ref = matmul_records_ref(x, pack_records(w, kind), kind, bias)
    # float32 sums per lane over the blocks: ulps of |x| @ |W|^T
    magnitude = np.abs(x.reshape(-1, x.shape[-1])).astype(np.float64) @ np.abs(dequantize(w, kind)).T
    bound = 2e-6 * (magnitude.reshape(ref.shape) + (np.abs(bias) if bias is not None else 0)) + 1e-30
    err = np.abs(y - ref)
    assert (err <= bound).all(), f"{float((err / bound).max()):.3g} of the bound"
    return y


# decode's one row, passes of 12 (VNNI) or 6 rows and their remainders, items of 32 rows and 2 groups, ragged both
@pytest.mark.parametrize("t, n, superblocks", [(1, 16, 1), (1, 48, 8), (3, 32, 2), (13, 16, 3), (37, 80, 2),
                                               (70, 16, 1)])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_kernel_matches_spec(kind, t, n, superblocks):
    rng = np.random.default_rng(t * 100 + n)
    w = blocks_of(kind, n, superblocks, seed=t + n)
    x = rng.standard_normal((t, 256 * superblocks)).astype(np.float32)
    x[:, 5] *= 30  # an outlier channel: its block's step is coarse
    if t > 2:
        x[1] = 0  # an all-zero row: step 0
    bias = rng.standard_normal(n).astype(np.float32) if t % 2 else None
    assert _check(w, x, bias, kind=kind).shape == (t, n)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_kernel_at_a_1b_shape_k(kind):
    rng = np.random.default_rng(11)
    _check(blocks_of(kind, 32, 8, seed=11), rng.standard_normal((6, 2048)).astype(np.float32), kind=kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_row_has_the_bits_of_the_row_alone_at_every_thread_count_and_rank_3(kind):
    """Decode (one row) against speculative verification and batches: the same bits for every row, in any pass and
    at any place in it, on one thread or two."""
    rng = np.random.default_rng(6)
    w = blocks_of(kind, 48, 2, seed=6)
    x = rng.standard_normal((37, 512)).astype(np.float32)
    x[:, 3] *= 20
    s = session(make_single_op_model(w, kind, rng.standard_normal(48).astype(np.float32), int8_activations=True,
                                     layout="records"))
    batch = s.run(None, {"x": x})[0]
    alone = np.concatenate([s.run(None, {"x": x[t:t + 1]})[0] for t in range(len(x))])
    np.testing.assert_array_equal(batch, alone)
    np.testing.assert_array_equal(s.run(None, {"x": x[5:16]})[0], batch[5:16])
    x3 = x[:36].reshape(4, 9, 512)
    np.testing.assert_array_equal(run_kernel(w, x3, threads=1, kind=kind).reshape(36, 48),
                                  run_kernel(w, x[:36], threads=2, kind=kind))


def _model_with(attribute: str, value, w=None):
    from onnx import helper

    model = make_single_op_model(q4_k(16, 1) if w is None else w, Q4_K, int8_activations=True, layout="records")
    node = model.graph.node[0]
    found = next(a for a in node.attribute if a.name == attribute)
    found.CopyFrom(helper.make_attribute(attribute, value))
    return model


def test_kernel_names_what_it_refuses():
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(Exception, match='layout must be "blocks" or "records", got "tiles"'):
        session(_model_with("layout", "tiles")).run(None, {"x": x})
    with pytest.raises(Exception, match="records\" is Q4_K's, Q5_K's, Q6_K's or Q8_0's .* got ggml_type 2"):
        session(_model_with("ggml_type", 2)).run(None, {"x": x})
    with pytest.raises(Exception, match=r"w must be uint8 Q6_K records \[N / 16, K / 256, 3392\], got \[1, 1, 2368\]"):
        session(_model_with("ggml_type", 14)).run(None, {"x": x})  # Q4_K's records read as Q6_K's
    with pytest.raises(Exception, match="int8_activations 0"):
        session(_model_with("int8_activations", 0)).run(None, {"x": x})


def test_kernel_names_records_of_the_wrong_size():
    from onnx import numpy_helper

    model = make_single_op_model(q4_k(16, 1), Q4_K, int8_activations=True, layout="records")
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((1, 1, 2304), np.uint8), "w"))
    with pytest.raises(Exception, match=r"w must be uint8 Q4_K records \[N / 16, K / 256, 2368\], got \[1, 1, 2304\]"):
        session(model).run(None, {"x": np.zeros((1, 256), np.float32)})


def _graph_of(blocks: dict[str, tuple[np.ndarray, int, int]]) -> ir.Model:
    """One kiln.MatMulGGUF per entry name -> (w, ggml_type, int8_activations) over a shared input."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["T", 256]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 21, OP_DOMAIN: 1})
    for name, (w, kind, int8) in blocks.items():
        value = ir.Value(name=name, shape=ir.Shape(w.shape), type=ir.TensorType(ir.DataType.UINT8))
        value.const_value = ir.tensor(w, name=name)
        graph.register_initializer(value)
        node = ir.node("MatMulGGUF", [x, value], attributes={"ggml_type": kind, "int8_activations": int8},
                       domain=OP_DOMAIN, name=f"{name}.MatMulGGUF")
        graph.append(node)
        graph.outputs.append(node.outputs[0])
    return ir.Model(graph, ir_version=10)


def test_the_build_pass_packs_only_what_the_kernel_takes():
    from kiln.optimize.pack_gguf_records import pack_gguf_records

    q6 = blocks_of(Q6_K, 16, 1, seed=1)
    q5 = random_blocks(np.random.default_rng(2), GgmlType.Q5_K, 16, 256)
    q8 = blocks_of(Q8_0, 16, 1, seed=3)
    model = _graph_of({"a": (q4_k(32, 1), Q4_K, 1), "odd": (q4_k(24, 1), Q4_K, 1), "float": (q4_k(16, 1), Q4_K, 0),
                       "q6": (q6, Q6_K, 1), "q5": (q5, GgmlType.Q5_K, 1), "q8": (q8, Q8_0, 1)})
    assert pack_gguf_records(model) == 4
    layouts = {n.name: n.attributes.get("layout") for n in model.graph}
    for name in ("a", "q6", "q8", "q5"):
        assert layouts[f"{name}.MatMulGGUF"] is not None and layouts[f"{name}.MatMulGGUF"].as_string() == "records"
    assert all(layouts[f"{name}.MatMulGGUF"] is None for name in ("odd", "float"))
    inits = model.graph.initializers
    assert "a" not in inits and "a.records" in inits  # the blocks go as their records come
    np.testing.assert_array_equal(inits["a.records"].const_value.numpy(), pack_q4_k_records(q4_k(32, 1)))
    np.testing.assert_array_equal(inits["q6.records"].const_value.numpy(), pack_q6_k_records(q6))
    np.testing.assert_array_equal(inits["q8.records"].const_value.numpy(), pack_q8_0_records(q8))
    assert pack_gguf_records(model) == 0  # records stay records
