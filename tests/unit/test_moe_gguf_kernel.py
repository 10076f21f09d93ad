"""kiln.MoE with GGUF experts: the spec (kiln/moe_gguf.py) against kiln.MatMulGGUF's int8 spec per expert, and the
ONNX Runtime CPU kernel against the spec over routings where some experts get no tokens, one token, or every token,
for Q4_K, Q6_K and Q8_0 experts, a Q4_K_M file's mix and gate/up of different types; a tolerance that a misplaced
scale, minimum or sub-block exceeds many times over; the bits of a token alone and in a batch; and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from kiln.gguf_blocks import FORMATS, GgmlType, random_blocks, row_bytes
from kiln.gguf_int8 import INT8_KINDS, matmul_gguf_int8_ref
from kiln.moe import moe_ref, route_ref
from kiln.moe_gguf import (
    GgufExperts,
    experts_from_records,
    experts_to_records,
    gguf_experts,
    make_single_op_model,
    moe_gguf_ref,
    records_packable,
)

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402
from test_moe_kernel import biased_router  # noqa: E402

LIBRARY = op_library_or_skip()
Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 = GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K, GgmlType.Q8_0, GgmlType.Q4_0
Q4_K_M = (Q4_K, Q4_K, Q6_K)  # llama.cpp's Q4_K_M: gate/up Q4_K, down Q6_K in its "more bits" layers


def experts_of(rng, e: int, d: int, f: int, types) -> GgufExperts:
    gate, up, down = (random_blocks(rng, kind, e * rows, cols).reshape(e, rows, -1)
                      for kind, rows, cols in zip(types, (f, f, d), (d, d, f), strict=True))
    return gguf_experts(gate, up, down, types, int8_activations=set(types) <= INT8_KINDS)


def session(model, threads: int = 2):
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(x, router, experts: GgufExperts, top_k: int, norm: bool, threads: int = 2,  # noqa: PLR0913 (the op's)
        int8_activations: bool | None = None) -> np.ndarray:
    model = make_single_op_model(top_k, norm, experts.types, rank=x.ndim, int8_activations=int8_activations)
    feeds = {"x": x, "router": router, "gate_up": experts.gate_up, "down": experts.down}
    return session(model, threads).run(None, feeds)[0]


def tolerance(want: np.ndarray) -> float:
    """float32 against float64 sums (the spec's docstring); a misplaced scale, minimum or sub-block is far above."""
    return 4e-6 * float(np.abs(want).max())


def case(rng, tokens: int, e: int, types, favoured: list[int] | None = None, d: int = 256):
    f = d  # D and F one k-quant block each
    experts = experts_of(rng, e, d, f, types)
    router = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    if favoured is not None:  # every token routes to `favoured`
        router = biased_router(e, d, favoured, rng)
        x = np.ones((tokens, d), np.float32) + 0.01 * x
    x[:, 5] *= 20  # an outlier widens its block's int8 step
    return x, router, experts


TYPES = {"q4_k_m": Q4_K_M, "q4_k": (Q4_K, Q4_K, Q4_K), "q6_k": (Q6_K, Q6_K, Q6_K), "q8_0": (Q8_0, Q8_0, Q8_0),
         "gate_q4_k_up_q6_k": (Q4_K, Q6_K, Q4_K),  # one activation quantization serves both, with both sums
         "gate_q8_0_up_q5_k": (Q8_0, Q5_K, Q4_0)}  # two activation blocks, gate's rows padded to up's width


@pytest.mark.parametrize("tokens, e, top_k, favoured", [
    (1, 8, 2, None),          # decode: two experts get the token, six get none
    (9, 6, 2, None),          # some experts idle, some with one token, some with several
    (11, 5, 2, [3, 1]),       # every token on one pair (more than a tile of rows), three experts idle
    (10, 4, 4, None),         # every expert gets every token
])
@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES.keys())
def test_kernel_matches_the_spec(types, tokens, e, top_k, favoured):
    rng = np.random.default_rng(tokens * 10 + e)
    x, router, experts = case(rng, tokens, e, types, favoured)
    routed, _ = route_ref(x, router, top_k, True)
    if favoured is not None:
        assert (routed == favoured).all()
    y = run(x, router, experts, top_k, True)
    want = moe_gguf_ref(x, router, experts, top_k=top_k, norm_topk_prob=True)
    np.testing.assert_allclose(y, want, rtol=0, atol=tolerance(want))
    # float32 activations on the same weights are further off than the tolerance: the test sees the int8 path
    float_acts = moe_ref(x, router, *experts.dequantized(), top_k=top_k, norm_topk_prob=True)
    assert np.abs(y - float_acts).max() > 50 * tolerance(want)


FLOAT_TYPES = {"q4_k_m": Q4_K_M, "q5_0_q5_1_q8_0": (GgmlType.Q5_0, GgmlType.Q5_1, Q8_0),
               "q5_k_q4_0_q6_k": (Q5_K, Q4_0, Q6_K)}


@pytest.mark.parametrize("tokens, e, top_k, favoured", [(1, 8, 2, None), (11, 5, 2, [3, 1]), (10, 4, 4, None)])
@pytest.mark.parametrize("types", FLOAT_TYPES.values(), ids=FLOAT_TYPES.keys())
def test_float_activations_match_the_files_weights(types, tokens, e, top_k, favoured):
    """int8_activations = 0 (gguf-exact): each projection x @ dequantize(W)^T, every type kiln.MatMulGGUF decodes
    (Q5_0 / Q5_1 too); the spec is moe_ref on the dequantized experts, to float32 rounding."""
    rng = np.random.default_rng(tokens * 7 + e)
    x, router, experts = case(rng, tokens, e, types, favoured)
    y = run(x, router, experts, top_k, False, int8_activations=False)
    want = moe_gguf_ref(x, router, experts, top_k=top_k, norm_topk_prob=False, int8_activations=False)
    np.testing.assert_allclose(want, moe_ref(x, router, *experts.dequantized(), top_k=top_k, norm_topk_prob=False),
                               rtol=0, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(y, want, rtol=0, atol=tolerance(want))
    if set(types) <= INT8_KINDS:  # the int8 path on the same blocks is further off: the attribute chooses the path
        assert np.abs(run(x, router, experts, top_k, False, int8_activations=True) - want).max() > 50 * tolerance(want)


def _misplaced(experts: GgufExperts, expert: int, where: str) -> GgufExperts:
    """experts with one Q4_K gate block of `expert` (or a Q6_K down block) altered as a layout slip would read it."""
    gate_up, down = experts.gate_up.copy(), experts.down.copy()
    block = gate_up[expert, 3, :FORMATS[Q4_K].nbytes]
    match where:
        case "scale":  # sub-blocks 0 and 1 swap their 6-bit scales (bytes 4, 5)
            block[[4, 5]] = block[[5, 4]]
        case "min":  # ... their minimums (bytes 8, 9)
            block[[8, 9]] = block[[9, 8]]
        case "sub-block":  # sub-blocks (0, 1) and (2, 3) swap their codes (qs bytes 0-31 and 32-63)
            block[16:80] = np.concatenate([block[48:80], block[16:48]])
        case "q6_k scale":
            down[expert, 7, 192:194] = down[expert, 7, 193:191:-1]
    return GgufExperts(gate_up, down, *experts.types)


@pytest.mark.parametrize("layout", ["blocks", "records"])
@pytest.mark.parametrize("where", ["scale", "min", "sub-block", "q6_k scale"])
def test_the_tolerance_sees_a_misplaced_scale_min_or_sub_block(where, layout):
    rng = np.random.default_rng(3)
    x, router, experts = case(rng, 3, 4, Q4_K_M, favoured=[2, 0])
    y = run_in(layout)(x, router, experts, 2, False)
    wrong = moe_gguf_ref(x, router, _misplaced(experts, 2, where), top_k=2, norm_topk_prob=False, layout=layout)
    assert np.abs(y - wrong).max() > 10 * tolerance(wrong)


def test_the_spec_is_matmul_gguf_int8_per_expert():
    """The spec's expert path written out for one token with kiln.MatMulGGUF's int8 reference."""
    rng = np.random.default_rng(4)
    x, router, experts = case(rng, 1, 4, Q4_K_M)
    chosen, weights = route_ref(x, router, 2, False)
    gate, up, down = (experts.gate_up[:, :256, :144], experts.gate_up[:, 256:, :144], experts.down)
    want = np.zeros(256)
    for j, w in zip(chosen[0], weights[0], strict=True):
        g = matmul_gguf_int8_ref(x, gate[j], Q4_K).astype(np.float64)[0]
        u = matmul_gguf_int8_ref(x, up[j], Q4_K).astype(np.float64)[0]
        act = (g / (1 + np.exp(-g)) * u).astype(np.float32)
        want += w * matmul_gguf_int8_ref(act[None], down[j], Q6_K)[0]
    np.testing.assert_allclose(moe_gguf_ref(x, router, experts, top_k=2, norm_topk_prob=False)[0], want,
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["blocks", "records"])
def test_a_tokens_output_is_bitwise_independent_of_its_batch_and_threads(layout):
    runner = run_in(layout)
    rng = np.random.default_rng(5)
    x, router, experts = case(rng, 19, 6, Q4_K_M)
    x3 = x[:18].reshape(2, 9, 256)
    batch = runner(x3, router, experts, 2, True)
    np.testing.assert_array_equal(batch, runner(x3, router, experts, 2, True, threads=1))
    for b, t in ((0, 0), (1, 4), (1, 8)):
        np.testing.assert_array_equal(runner(x3[b, t:t + 1], router, experts, 2, True), batch[b, t:t + 1])


def test_stacks_of_the_wrong_width_and_types_without_a_kernel_are_named():
    rng = np.random.default_rng(6)
    x, router, experts = case(rng, 2, 4, Q4_K_M)
    narrow = GgufExperts(experts.gate_up[..., :-4], experts.down, *experts.types)
    with pytest.raises(Exception, match=r"GGUF gate_up must be \[E, 2F, 144\]"):
        run(x, router, narrow, 2, True)
    wide_down = GgufExperts(experts.gate_up, experts.gate_up[:, :256], *experts.types)
    with pytest.raises(Exception, match=r"GGUF down must be \[4, 256, 210\]"):
        run(x, router, wide_down, 2, True)
    model = make_single_op_model(2, True, (Q4_K, Q4_K, GgmlType.Q5_1))
    feeds = {"x": x, "router": router, "gate_up": experts.gate_up, "down": experts.down}
    with pytest.raises(Exception, match="down_type 7 has no kernel for GGUF experts with int8 activations"):
        session(model).run(None, feeds)
    float_model = make_single_op_model(2, True, (Q4_K, Q4_K, 10), int8_activations=False)  # Q2_K
    with pytest.raises(Exception, match=r"down_type 10 has no kernel for GGUF experts \(Q4_0 = 2, Q5_0 = 6"):
        session(float_model).run(None, feeds)
    with pytest.raises(Exception, match="int8_activations must be 0 .* or 1"):
        model.graph.node[0].attribute.append(helper.make_attribute("int8_activations", 2))
        session(model).run(None, feeds)
    with pytest.raises(ValueError, match="down has ggml type 7, which kiln.MoE's GGUF experts with int8 activations"):
        gguf_experts(experts.gate_up[:, :256], experts.gate_up[:, 256:], experts.down, (Q4_K, Q4_K, 7))
    bad_f = np.zeros((4, 128, row_bytes(Q8_0, 256)), np.uint8)
    with pytest.raises(ValueError, match="Q6_K rows hold whole blocks of 256 weights, got K = 128"):
        gguf_experts(bad_f, bad_f, np.zeros((4, 256, 210), np.uint8), (Q8_0, Q8_0, Q6_K))


# ---- records (layout "records"): each expert's kiln.MatMulGGUF records, expert after expert

RECORD_TYPES = {"q4_k_m": Q4_K_M, "q4_k": (Q4_K, Q4_K, Q4_K), "q6_k": (Q6_K, Q6_K, Q6_K), "q8_0": (Q8_0,) * 3,
                "q5_k_m": (Q5_K, Q5_K, Q6_K)}


def run_records(x, router, experts: GgufExperts, top_k: int, norm: bool, threads: int = 2) -> np.ndarray:
    gate_up, down = experts_to_records(experts.gate_up, experts.down, experts.types)
    model = make_single_op_model(top_k, norm, experts.types, rank=x.ndim, layout="records")
    return session(model, threads).run(None, {"x": x, "router": router, "gate_up": gate_up, "down": down})[0]


def run_in(layout: str):
    """The op runner for experts held in `layout` (the blocks as the test makes them, or their records)."""
    return run_records if layout == "records" else run


def test_records_hold_the_files_expert_blocks():
    rng = np.random.default_rng(9)
    experts = experts_of(rng, 3, 512, 256, Q4_K_M)
    gate_up, down = experts_to_records(experts.gate_up, experts.down, experts.types)
    assert gate_up.shape == (3, 2 * 256 // 16, 2, 2368) and down.shape == (3, 512 // 16, 1, 3392)
    back = experts_from_records(gate_up, down, experts.types)
    np.testing.assert_array_equal(back[0], experts.gate_up)
    np.testing.assert_array_equal(back[1], experts.down)
    assert records_packable(Q4_K_M, True, 512, 256)
    assert not records_packable((Q4_K, Q6_K, Q4_K), True, 512, 256)  # gate and up of two types
    assert not records_packable(Q4_K_M, False, 512, 256)
    assert records_packable((Q8_0,) * 3, True, 512, 256) and not records_packable((Q8_0,) * 3, True, 512, 96)


@pytest.mark.parametrize("tokens, e, top_k, favoured", [
    (1, 8, 2, None),          # decode: two experts get the token, six get none
    (9, 6, 2, None),          # some experts idle, some with one token, some with several
    (14, 5, 2, [3, 1]),       # every token on one pair (more than a 12-row pass), three experts idle
    (10, 4, 4, None),         # every expert gets every token
])
@pytest.mark.parametrize("types", RECORD_TYPES.values(), ids=RECORD_TYPES.keys())
def test_records_kernel_matches_the_spec(types, tokens, e, top_k, favoured):
    rng = np.random.default_rng(tokens * 10 + e + 1)
    x, router, experts = case(rng, tokens, e, types, favoured)
    y = run_records(x, router, experts, top_k, True)
    want = moe_gguf_ref(x, router, experts, top_k=top_k, norm_topk_prob=True, layout="records")
    np.testing.assert_allclose(y, want, rtol=0, atol=tolerance(want))
    # the k-quants' blocks arithmetic (activations per 256) is further off than the tolerance: the test sees the
    # layout's (Q8_0's blocks quantize per 32 as its records do: the same numbers)
    if types[0] != Q8_0:
        blocks = moe_gguf_ref(x, router, experts, top_k=top_k, norm_topk_prob=True)
        assert np.abs(y - blocks).max() > 10 * tolerance(want)


def test_records_of_the_wrong_shape_or_types_are_named():
    rng = np.random.default_rng(6)
    x, router, experts = case(rng, 2, 4, Q4_K_M)
    gate_up, down = experts_to_records(experts.gate_up, experts.down, experts.types)
    feeds = {"x": x, "router": router, "gate_up": gate_up, "down": down}
    mixed = make_single_op_model(2, True, (Q4_K, Q6_K, Q6_K), layout="records")
    with pytest.raises(Exception, match="gate and up of one type; got gate_type 12, up_type 14"):
        session(mixed).run(None, feeds)
    with pytest.raises(Exception, match=r"GGUF down records must be \[4, 16, 1, 3392\]"):
        session(make_single_op_model(2, True, Q4_K_M, layout="records")).run(None, {**feeds, "down": down[:, :8]})
    float_model = make_single_op_model(2, True, Q4_K_M, int8_activations=False, layout="records")
    with pytest.raises(Exception, match="records\" holds GGUF experts for int8 activations"):
        session(float_model).run(None, feeds)
