"""kiln.MoE: the numpy reference against a token-by-token loop written out, and the ONNX Runtime CPU kernel
(libkiln_ops.so) against the reference over routings where some experts get no tokens, one token, or every token;
with and without renormalisation, odd widths (SIMD tails), the thread pool, and errors on bad shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.matmul_q4_1 import BLOCKS, RECORDS
from kiln.moe import (
    make_single_op_model,
    moe_q4_1_ref,
    moe_ref,
    pack_q4_1_experts,
    q4_1_expert,
    q4_1_experts_from_records,
    q4_1_experts_to_records,
    route_ref,
    unpack_q4_1_experts,
)

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()


def weights(rng, experts: int, d: int, f: int):
    router = rng.standard_normal((experts, d)).astype(np.float32)
    gate_up = (rng.standard_normal((experts, 2 * f, d)) / np.sqrt(d)).astype(np.float32)
    down = (rng.standard_normal((experts, d, f)) / np.sqrt(f)).astype(np.float32)
    return router, gate_up, down


def run(x, experts: tuple[np.ndarray, ...], top_k: int, norm: bool, threads: int = 1) -> np.ndarray:
    """The kernel's y for x and experts = (router, gate_up, down)."""
    router, gate_up, down = experts
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = threads
    model = make_single_op_model(top_k, norm, rank=x.ndim)
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "router": router, "gate_up": gate_up, "down": down})[0]


def test_reference_is_the_token_by_token_sum():
    rng = np.random.default_rng(0)
    router, gate_up, down = weights(rng, 5, 12, 7)
    x = rng.standard_normal((4, 12)).astype(np.float32)
    y = moe_ref(x, router, gate_up, down, top_k=2, norm_topk_prob=True)
    for t in range(4):
        logits = router.astype(np.float64) @ x[t]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        best = np.argsort(-p)[:2]
        want = np.zeros(12)
        for e in best:
            h = gate_up[e].astype(np.float64) @ x[t]
            act = h[:7] / (1 + np.exp(-h[:7])) * h[7:]
            want += p[e] / p[best].sum() * (down[e].astype(np.float64) @ act)
        np.testing.assert_allclose(y[t], want, rtol=1e-5, atol=1e-6)


def test_routing_ties_keep_the_lower_expert_first_and_weights_follow_the_flag():
    router = np.array([[1.0], [2.0], [2.0], [0.0]], np.float32)
    experts, weights_norm = route_ref(np.ones((1, 1), np.float32), router, 3, True)
    assert experts.tolist() == [[1, 2, 0]]
    assert weights_norm.sum() == pytest.approx(1.0)
    _, weights_raw = route_ref(np.ones((1, 1), np.float32), router, 3, False)
    assert weights_raw.sum() < 0.99


def biased_router(experts: int, d: int, favoured: list[int], rng) -> np.ndarray:
    """A router whose logits for x = ones are huge for `favoured` (in that order) and small for the rest."""
    router = (rng.standard_normal((experts, d)) * 0.01).astype(np.float32)
    for rank, e in enumerate(favoured):
        router[e] += (10.0 - rank) / d
    return router


@pytest.mark.parametrize("tokens, experts, top_k, d, f, norm", [
    (1, 4, 2, 16, 8, True),      # decode: two experts get one token, two get none
    (7, 8, 2, 64, 40, True),     # Mixtral's top-2
    (9, 16, 8, 48, 24, False),   # OLMoE-like top-8, no renormalisation
    (33, 6, 6, 20, 13, True),    # every expert gets every token; odd D and F (SIMD tails)
    (5, 3, 1, 8, 3, False),      # top-1
])
def test_kernel_matches_reference(tokens, experts, top_k, d, f, norm):
    rng = np.random.default_rng(tokens * 100 + experts)
    router, gate_up, down = weights(rng, experts, d, f)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    y = run(x, (router, gate_up, down), top_k, norm)
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, moe_ref(x, router, gate_up, down, top_k=top_k, norm_topk_prob=norm),
                               rtol=1e-4, atol=1e-5)


def test_all_tokens_to_one_expert_pair_and_none_to_the_others():
    """Every token routes to experts 3 and 1 (in that order): four experts idle, one pair gets the whole batch."""
    rng = np.random.default_rng(3)
    _, gate_up, down = weights(rng, 6, 24, 16)
    router = biased_router(6, 24, [3, 1], rng)
    x = np.ones((11, 24), np.float32) + 0.01 * rng.standard_normal((11, 24)).astype(np.float32)
    experts, _ = route_ref(x, router, 2, True)
    assert (experts == [3, 1]).all()
    np.testing.assert_allclose(run(x, (router, gate_up, down), 2, True),
                               moe_ref(x, router, gate_up, down, top_k=2, norm_topk_prob=True), rtol=1e-4, atol=1e-5)


def test_perturbed_routing_changes_the_output():
    """The kernel's output tells top_k, renormalisation and expert identity apart (a kernel getting any of them
    wrong fails the reference comparison above)."""
    rng = np.random.default_rng(4)
    router, gate_up, down = weights(rng, 8, 32, 16)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    y = run(x, (router, gate_up, down), 2, True)
    for other in (moe_ref(x, router, gate_up, down, top_k=3, norm_topk_prob=True),
                  moe_ref(x, router, gate_up, down, top_k=2, norm_topk_prob=False),
                  moe_ref(x, router, gate_up[::-1].copy(), down, top_k=2, norm_topk_prob=True)):
        assert np.abs(y - other).max() > 1e-2


def test_threads_and_rank_three():
    """Many work items on the pool (F = 200: 13 gate/up chunks per expert) and a [B, T, D] input."""
    rng = np.random.default_rng(5)
    router, gate_up, down = weights(rng, 8, 96, 200)
    x = rng.standard_normal((2, 40, 96)).astype(np.float32)
    want = moe_ref(x, router, gate_up, down, top_k=4, norm_topk_prob=True)
    np.testing.assert_allclose(run(x, (router, gate_up, down), 4, True, 2), want, rtol=1e-4, atol=1e-5)


def test_empty_batch():
    rng = np.random.default_rng(6)
    router, gate_up, down = weights(rng, 4, 8, 4)
    assert run(np.zeros((0, 8), np.float32), (router, gate_up, down), 2, True).shape == (0, 8)


@pytest.mark.parametrize("change, message", [
    ({"router": np.zeros((4, 9), np.float32)}, "router must be"),
    ({"gate_up": np.zeros((4, 7, 8), np.float32)}, "gate_up must be"),
    ({"down": np.zeros((4, 8, 5), np.float32)}, "down must be"),
])
def test_bad_shapes_are_named(change, message):
    rng = np.random.default_rng(7)
    router, gate_up, down = weights(rng, 4, 8, 4)
    inputs = {"router": router, "gate_up": gate_up, "down": down, **change}
    with pytest.raises(Exception, match=message):
        run(np.zeros((3, 8), np.float32), (inputs["router"], inputs["gate_up"], inputs["down"]), 2, True)
    with pytest.raises(ValueError, match=message):
        moe_ref(np.zeros((3, 8), np.float32), inputs["router"], inputs["gate_up"], inputs["down"], top_k=2,
                norm_topk_prob=True)


def test_top_k_beyond_the_experts_is_refused():
    rng = np.random.default_rng(8)
    router, gate_up, down = weights(rng, 4, 8, 4)
    with pytest.raises(Exception, match="top_k must be in"):
        run(np.zeros((3, 8), np.float32), (router, gate_up, down), 5, True)


def q4_1_experts(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [E, rows, K] in Q4_1 (llama.cpp's rounding: optimize/quant/rtn.py), as the op's (nibbles, dm)."""
    from kiln.optimize.quant.rtn import quantize_q4_1

    e, rows, k = w.shape
    q = quantize_q4_1(w.reshape(e * rows, k))
    return pack_q4_1_experts(q.q.reshape(e, rows, k), q.d.reshape(e, rows, -1), q.m.reshape(e, rows, -1))


def run_q4_1(x, router, gate_up, down, top_k: int, norm: bool,  # noqa: PLR0913 (the op's inputs)
             layout: str = BLOCKS, centre: float | None = None) -> np.ndarray:
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = 2
    model = make_single_op_model(top_k, norm, q4_1=True, layout=layout, centre=centre)
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    (gu, gu_dm), (dn, dn_dm) = gate_up, down
    return session.run(None, {"x": x, "router": router, "gate_up": gu, "down": dn, "gate_up_dm": gu_dm,
                              "down_dm": dn_dm})[0]


def test_q4_1_packing_round_trips_llama_cpp_numbers():
    from kiln.optimize.quant.rtn import quantize_q4_1

    w = np.random.default_rng(9).standard_normal((3, 5, 64)).astype(np.float32)
    nibbles, dm = q4_1_experts(w)
    assert nibbles.shape == (3, 5, 32) and dm.shape == (3, 5, 2, 2) and dm.dtype == np.float16
    want = quantize_q4_1(w.reshape(15, 64)).dequantize().reshape(3, 5, 64)
    np.testing.assert_array_equal(unpack_q4_1_experts(nibbles, dm), want)
    assert np.abs(want - w).max() < 0.5  # and they are w's 4-bit rounding


def q4_1_tolerance(want: np.ndarray) -> float:
    """float32 against float64 sums (the spec's docstring); a misplaced int8 step, sum or centring term is far above."""
    return 4e-6 * float(np.abs(want).max())


def q4_1_case(rng, tokens: int, experts: int, d: int, f: int, favoured: list[int] | None = None):
    """x, router and Q4_1 (gate_up, down); with `favoured`, every token routes to those experts (x near ones)."""
    router, gate_up, down = weights(rng, experts, d, f)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    if favoured is not None:
        router = biased_router(experts, d, favoured, rng)
        x = np.ones((tokens, d), np.float32) + 0.01 * x
        x[:, 5] = 3.0  # an outlier widens its block's int8 step
    return x, router, q4_1_experts(gate_up), q4_1_experts(down)


@pytest.mark.parametrize("tokens, experts, top_k, d, f, favoured", [
    (1, 8, 2, 64, 96, None),         # decode: two experts get the token, six get none
    (3, 16, 2, 64, 32, None),        # most experts idle, some with one token
    (21, 16, 8, 96, 64, None),       # OLMoE-like top-8 over 16 experts
    (40, 4, 4, 32, 32, None),        # every expert gets every token
    (17, 6, 2, 64, 64, [3, 1]),      # all tokens on one pair (more than a pass of rows), four experts idle
])
def test_q4_1_kernel_matches_the_int8_spec(tokens, experts, top_k, d, f, favoured):  # noqa: PLR0913 (the case)
    rng = np.random.default_rng(tokens + experts)
    x, router, gu, dn = q4_1_case(rng, tokens, experts, d, f, favoured)
    routed, _ = route_ref(x, router, top_k, True)
    if favoured is not None:
        assert (routed == favoured).all()
    y = run_q4_1(x, router, gu, dn, top_k, True)
    want = moe_q4_1_ref(x, router, gu, dn, top_k=top_k, norm_topk_prob=True)
    tolerance = q4_1_tolerance(want)
    np.testing.assert_allclose(y, want, rtol=0, atol=tolerance)
    # float32 activations on the same weights are further off than the tolerance: the test sees the int8 path
    float_acts = moe_ref(x, router, unpack_q4_1_experts(*gu), unpack_q4_1_experts(*dn), top_k=top_k,
                         norm_topk_prob=True)
    assert np.abs(y - float_acts).max() > 50 * tolerance


def test_q4_1_spec_is_matmul_q4_1_per_expert():
    """The spec's expert path written out for one token: MatMulQ4_1's reference for gate/up and for down."""
    from kiln.matmul_q4_1 import Q4_1Weights, matmul_q4_1_ref

    rng = np.random.default_rng(13)
    x, router, gu, dn = q4_1_case(rng, 1, 4, 64, 32)
    experts, weights_ = route_ref(x, router, 2, False)

    def expert(stack: tuple[np.ndarray, np.ndarray], e: int) -> Q4_1Weights:
        nibbles, dm = stack
        blocks = nibbles[e].reshape(nibbles.shape[1], -1, 16)
        q = np.concatenate([blocks & 15, blocks >> 4], axis=-1).reshape(nibbles.shape[1], -1)
        return Q4_1Weights(q, dm[e, ..., 0].copy(), dm[e, ..., 1].copy())

    want = np.zeros(64)
    for e, w in zip(experts[0], weights_[0], strict=True):
        h = matmul_q4_1_ref(x, *expert(gu, e).pack()).astype(np.float64)[0]
        act = (h[:32] / (1 + np.exp(-h[:32])) * h[32:]).astype(np.float32)
        want += w * matmul_q4_1_ref(act[None], *expert(dn, e).pack())[0]
    np.testing.assert_allclose(moe_q4_1_ref(x, router, gu, dn, top_k=2, norm_topk_prob=False)[0], want,
                               rtol=1e-6, atol=1e-7)


def constant_experts_session(router, gate_up, down, layout: str = BLOCKS, threads: int = 0):
    """A top-2 kiln.MoE session whose router and Q4_1 experts ((weights, dm) each, in `layout`) are initializers, as an
    engine's are; x is its one input."""
    from onnx import numpy_helper

    arrays = {"router": router, "gate_up": gate_up[0], "down": down[0], "gate_up_dm": gate_up[1], "down_dm": down[1]}
    model = make_single_op_model(2, True, q4_1=True, layout=layout)
    keep = [value for value in model.graph.input if value.name == "x"]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in arrays.items())
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_constant_q4_1_experts_packed_at_load_compute_the_same_bits():
    """An engine's experts are initializers, repacked once when the session loads; the per-call packing of graph
    inputs must give the same bits."""
    rng = np.random.default_rng(14)
    x, router, gu, dn = q4_1_case(rng, 9, 8, 64, 64)
    session = constant_experts_session(router, gu, dn, threads=2)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], run_q4_1(x, router, gu, dn, 2, True))


def test_q4_1_experts_need_their_steps_and_whole_blocks():
    rng = np.random.default_rng(10)
    router, gate_up, down = weights(rng, 4, 32, 32)
    gu, dn = q4_1_experts(gate_up), q4_1_experts(down)
    with pytest.raises(Exception, match="gate_up_dm must be"):
        run_q4_1(np.zeros((2, 32), np.float32), router, (gu[0], dn[1]), dn, 2, True)


def test_a_tokens_output_is_bitwise_independent_of_its_batch():
    """Decode (one token) and the same token inside a packed prefill give the same bits: speculative verification
    rows compute what decode would."""
    rng = np.random.default_rng(11)
    router, gate_up, down = weights(rng, 8, 64, 48)
    x = rng.standard_normal((37, 64)).astype(np.float32)
    batch = run(x, (router, gate_up, down), 2, True, 2)
    for t in (0, 17, 36):
        np.testing.assert_array_equal(run(x[t:t + 1], (router, gate_up, down), 2, True), batch[t:t + 1])


def test_q4_1_tokens_are_bitwise_independent_of_their_batch():
    """Q4_1 experts tile four tokens per unpacked block; a token alone (tile of one) gets the same bits."""
    rng = np.random.default_rng(12)
    router, gate_up, down = weights(rng, 4, 64, 64)
    gu, dn = q4_1_experts(gate_up), q4_1_experts(down)
    x = rng.standard_normal((23, 64)).astype(np.float32)
    batch = run_q4_1(x, router, gu, dn, 2, True)
    for t in (0, 5, 22):
        np.testing.assert_array_equal(run_q4_1(x[t:t + 1], router, gu, dn, 2, True), batch[t:t + 1])


# ---- the records layout: what an engine stores, read by the kernel where it lies

def test_q4_1_records_are_each_experts_matmul_q4_1_records_in_turn():
    rng = np.random.default_rng(20)
    nibbles, dm = q4_1_experts(rng.standard_normal((3, 48, 96)).astype(np.float32))
    records, rows = q4_1_experts_to_records(nibbles, dm)
    assert records.shape == (3, 3, 3, 320) and records.dtype == np.uint8
    assert rows.shape == (3, 48, 0) and rows.dtype == np.float16
    for e in range(3):
        np.testing.assert_array_equal(records[e], q4_1_expert(nibbles, dm, e).pack_records()[0])
    back = q4_1_experts_from_records(records, rows)
    np.testing.assert_array_equal(back[0], nibbles)
    np.testing.assert_array_equal(back[1], dm)
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        q4_1_experts_to_records(nibbles[:, :40], dm[:, :40])


@pytest.mark.parametrize("tokens, experts, top_k, d, f, favoured", [
    (1, 8, 2, 64, 96, None),         # decode: two experts get the token, six get none
    (3, 16, 2, 64, 32, None),        # most experts idle, some with one token
    (40, 4, 4, 32, 32, None),        # every expert gets every token
    (17, 6, 2, 64, 64, [3, 1]),      # all tokens on one pair (more than a pass of rows), four experts idle
])
def test_q4_1_kernel_on_records_is_bitwise_the_kernel_on_blocks(tokens, experts, top_k, d, f, favoured):  # noqa: PLR0913
    """Records given as the op's inputs compute the bits the kernel computes from blocks it packs itself (numpy's
    records are the kernel's packing byte for byte: an expert, lane or nibble out of place would differ)."""
    rng = np.random.default_rng(tokens + experts + 1)
    x, router, gu, dn = q4_1_case(rng, tokens, experts, d, f, favoured)
    gu_records, dn_records = q4_1_experts_to_records(*gu), q4_1_experts_to_records(*dn)
    blocks = run_q4_1(x, router, gu, dn, top_k, True)
    records = run_q4_1(x, router, gu_records, dn_records, top_k, True, layout=RECORDS)
    np.testing.assert_array_equal(records, blocks)
    spec = moe_q4_1_ref(x, router, gu_records, dn_records, top_k=top_k, norm_topk_prob=True, layout=RECORDS)
    np.testing.assert_array_equal(spec, moe_q4_1_ref(x, router, gu, dn, top_k=top_k, norm_topk_prob=True))


def test_constant_q4_1_records_compute_the_constant_blocks_bits():
    """An engine's records are initializers, read in place; the same experts as constant blocks are packed at load."""
    rng = np.random.default_rng(21)
    x, router, gu, dn = q4_1_case(rng, 9, 8, 64, 64)
    records = constant_experts_session(router, q4_1_experts_to_records(*gu), q4_1_experts_to_records(*dn), RECORDS)
    blocks = constant_experts_session(router, gu, dn)
    np.testing.assert_array_equal(records.run(None, {"x": x})[0], blocks.run(None, {"x": x})[0])


def test_malformed_q4_1_records_are_named():
    rng = np.random.default_rng(22)
    x, router, gu, dn = q4_1_case(rng, 2, 4, 64, 32)
    gu_records, dn_records = q4_1_experts_to_records(*gu), q4_1_experts_to_records(*dn)
    with pytest.raises(Exception, match=r"kiln.MoE: gate_up must be uint8 records \[E=4, 2F/16 \(F a multiple of "
                                        r"32\), D/32=2, 320\] with layout \"records\", got \[4, 4, 2, 256\]"):
        run_q4_1(x, router, (gu_records[0][..., :256].copy(), gu_records[1]), dn_records, 2, True, layout=RECORDS)
    with pytest.raises(Exception, match=r"kiln.MoE: down must be uint8 records \[E, D/16, F/32, 320\] = "
                                        r"\[4, 4, 1, 320\]"):
        run_q4_1(x, router, gu_records, (dn_records[0][:, :2].copy(), dn_records[1]), 2, True, layout=RECORDS)
    with pytest.raises(Exception, match=r"kiln.MoE: down_dm must be float16 \[4, 64, 0\] with layout \"records\""):
        run_q4_1(x, router, gu_records, (dn_records[0], dn[1]), 2, True, layout=RECORDS)  # blocks' dm
    with pytest.raises(Exception, match=r"kiln.MoE: gate_up must be uint8 records"):
        run_q4_1(x, router, gu, dn, 2, True, layout=RECORDS)  # blocks under the records layout
    model = make_single_op_model(2, True, q4_1=True, layout=RECORDS)
    next(a for a in model.graph.node[0].attribute if a.name == "layout").s = b"rows"
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    with pytest.raises(Exception, match=r"kiln.MoE: layout must be \"blocks\" or \"records\", got \"rows\""):
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            None, {"x": x, "router": router, "gate_up": gu_records[0], "down": dn_records[0],
                   "gate_up_dm": gu_records[1], "down_dm": dn_records[1]})


@pytest.mark.parametrize("layout", [BLOCKS, RECORDS])
def test_q4_1_experts_take_the_nodes_centre(layout):
    """Q4_0 experts run as Q4_1 ones centred at 8: both projections of every expert use the node's centre."""
    from kiln.matmul_q4_1 import Q4_0_CENTRE
    from kiln.moe import q4_1_experts_to_records

    rng = np.random.default_rng(31)
    x, router, gu, dn = q4_1_case(rng, 9, 8, 64, 96)
    want = moe_q4_1_ref(x, router, gu, dn, top_k=2, norm_topk_prob=False, centre=Q4_0_CENTRE)
    stacks = [q4_1_experts_to_records(*s) if layout == RECORDS else s for s in (gu, dn)]
    y = run_q4_1(x, router, *stacks, 2, False, layout=layout, centre=Q4_0_CENTRE)
    tolerance = q4_1_tolerance(want)
    np.testing.assert_allclose(y, want, rtol=0, atol=tolerance)
    assert np.abs(y - moe_q4_1_ref(x, router, gu, dn, top_k=2, norm_topk_prob=False)).max() > 10 * tolerance


def test_a_centre_on_float_experts_is_refused():
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    with pytest.raises(Exception, match=r"kiln.MoE: centre is for Q4_1 experts"):
        ort.InferenceSession(make_single_op_model(2, True, centre=8.0).SerializeToString(), so,
                             providers=["CPUExecutionProvider"])
