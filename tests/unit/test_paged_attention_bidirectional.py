"""kiln.PagedAttention's attend_until input (Gemma 3's bidirectional image runs): the numpy reference against
dense attention with the run's mask, the ONNX Runtime kernel against the reference on every path (float, fp16
and int8 pools, RoPE inside the op, several query chunks, split long contexts, a sliding window), the causal
default unchanged bit for bit, and clear errors on bad bounds."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.contract import ATTEND_UNTIL
from kiln.paged_attention import (
    PagedAttentionAttrs,
    PagedAttentionInputs,
    QkvLayout,
    make_single_op_model,
    paged_attention_ref,
    token_positions,
)

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402
from test_paged_attention_kernel import OpCase, check, check_rotary, make_case, model_session  # noqa: E402

LIBRARY = op_library_or_skip()


def runs_until(seq_lens: np.ndarray, qsl: np.ndarray, runs: list[tuple[int, int, int]]) -> np.ndarray:
    """attend_until for (sequence, first position, last position) runs: causal elsewhere."""
    positions = token_positions(seq_lens, qsl)
    until = positions.astype(np.int32)
    for s, first, last in runs:
        for t in range(int(qsl[s]), int(qsl[s + 1])):
            if first <= positions[t] <= last:
                until[t] = last
    return until


def session(op: OpCase, rotary: bool):
    return model_session(make_single_op_model(op.attrs, op.head_dim, op.block_size, np.dtype(op.kv_dtype), rotary,
                                              QkvLayout(attend_until=True)))


def test_reference_equals_dense_attention_with_a_bidirectional_run():
    rng = np.random.default_rng(0)
    op = OpCase(PagedAttentionAttrs(4, 2), 8, 4)
    feeds = make_case(rng, [(0, 12)], op)
    feeds[ATTEND_UNTIL] = runs_until(feeds["seq_lens"], feeds["query_start_loc"], [(0, 3, 8)])
    out, _ = paged_attention_ref(PagedAttentionInputs(**feeds), op.attrs)
    q = feeds["query"].reshape(12, 4, 8).astype(np.float64)
    k = np.repeat(feeds["key"].reshape(12, 2, 8), 2, axis=1).astype(np.float64)
    v = np.repeat(feeds["value"].reshape(12, 2, 8), 2, axis=1).astype(np.float64)
    pos = np.arange(12)
    allowed = (pos[None, :] <= pos[:, None]) | ((pos[:, None] >= 3) & (pos[:, None] <= 8) & (pos[None, :] <= 8))
    scores = np.where(allowed[None], np.einsum("qhd,khd->hqk", q, k) / np.sqrt(8), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    dense = np.einsum("hqk,khd->qhd", probs, v).reshape(12, 32)
    np.testing.assert_allclose(out, dense, rtol=1e-6, atol=1e-6)
    causal, _ = paged_attention_ref(PagedAttentionInputs(**{**feeds, ATTEND_UNTIL: None}), op.attrs)
    assert np.abs(causal[3:8] - dense[3:8]).max() > 1e-2  # the run's tokens see later ones
    np.testing.assert_array_equal(causal[np.r_[0:3, 8:12]], out[np.r_[0:3, 8:12]])


CASES = {  # (cached, new) per sequence; runs (sequence, first, last position)
    "one-run": ([(0, 20)], [(0, 5, 14)]),
    "chunk-start-inside-run": ([(7, 9), (3, 1)], [(0, 4, 12)]),
    "many-query-chunks": ([(2, 150)], [(0, 10, 90), (0, 100, 140)]),
    "split-long-context": ([(400, 40)], [(0, 410, 430)]),
    "two-sequences": ([(0, 30), (16, 20)], [(0, 0, 29), (1, 20, 35)]),
}


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(case, kv_dtype, rotary):
    seqs, runs = CASES[case]
    rng = np.random.default_rng(len(case))
    op = OpCase(PagedAttentionAttrs(6, 2, sliding_window=64 if case == "many-query-chunks" else 0), 16, 16, kv_dtype,
                rotary_positions=512 if rotary else 0)
    feeds = make_case(rng, seqs, op)
    feeds[ATTEND_UNTIL] = runs_until(feeds["seq_lens"], feeds["query_start_loc"], runs)
    out, pool = session(op, rotary).run(None, feeds)
    ref_out, ref_pool = paged_attention_ref(PagedAttentionInputs(**feeds), op.attrs)
    if rotary:
        check_rotary(out, pool, ref_out, ref_pool, kv_dtype)
    else:
        check(out, pool, ref_out, ref_pool)
    causal, _ = paged_attention_ref(PagedAttentionInputs(**{**feeds, ATTEND_UNTIL: None}), op.attrs)
    assert np.abs(causal - out).max() > 1e-2  # the bounds changed the result


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_causal_bounds_and_no_bounds_are_bit_identical(kv_dtype):
    """attend_until = each token's own position, an empty [0] tensor and the op without the input agree exactly."""
    from test_paged_attention_kernel import session as plain_session

    rng = np.random.default_rng(5)
    op = OpCase(PagedAttentionAttrs(4, 2), 16, 16, kv_dtype)
    feeds = make_case(rng, [(30, 40), (100, 1), (0, 7)], op)
    baseline = plain_session(op).run(None, feeds)
    bounded = session(op, False)
    positions = token_positions(feeds["seq_lens"], feeds["query_start_loc"]).astype(np.int32)
    for until in (positions, np.zeros(0, np.int32)):
        for got, want in zip(bounded.run(None, {**feeds, ATTEND_UNTIL: until}), baseline, strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("change", "message"), [
    (lambda u: u - 1, "must be from the token's position"),
    (lambda u: u + 100, "to its sequence's last"),
    (lambda u: u[:-1], r"attend_until must be int32 \[num_tokens=12\]"),
])
def test_bad_bounds_raise_clear_errors(change, message):
    rng = np.random.default_rng(1)
    op = OpCase(PagedAttentionAttrs(2, 2), 8, 4)
    feeds = make_case(rng, [(4, 12)], op)
    until = token_positions(feeds["seq_lens"], feeds["query_start_loc"]).astype(np.int32)
    with pytest.raises(Exception, match=message):
        session(op, False).run(None, {**feeds, ATTEND_UNTIL: change(until)})
    if message != "to its sequence's last":
        return
    with pytest.raises(ValueError, match="attend_until"):
        PagedAttentionInputs(**{**feeds, ATTEND_UNTIL: change(until)})


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_the_pass_feeds_every_op_its_11th_input(kv_dtype):
    """attach_attend_until on an op without RoPE inside (7 or 8 inputs): empty kv_scale / cos / sin placeholders,
    then attend_until; the graph then runs the bounds as the reference does."""
    import onnx_ir as ir

    from kiln.optimize.attach_attend_until import attach_attend_until

    op = OpCase(PagedAttentionAttrs(4, 2), 16, 16, kv_dtype)
    model = ir.from_proto(make_single_op_model(op.attrs, op.head_dim, op.block_size, np.dtype(kv_dtype)))
    assert attach_attend_until(model) == 1
    node = next(iter(model.graph))
    assert len(node.inputs) == 11 and node.inputs[10].name == ATTEND_UNTIL
    feeds = make_case(np.random.default_rng(3), [(5, 30)], op)
    feeds[ATTEND_UNTIL] = runs_until(feeds["seq_lens"], feeds["query_start_loc"], [(0, 10, 27)])
    out, pool = model_session(ir.to_proto(model)).run(None, feeds)
    check(out, pool, *paged_attention_ref(PagedAttentionInputs(**feeds), op.attrs))


def test_tensorrt_lowering_refuses_the_bounds():
    import onnx_ir as ir

    from kiln.optimize.lower_tensorrt import TensorRTLoweringError, lower_for_tensorrt

    model = make_single_op_model(PagedAttentionAttrs(4, 2), 16, 16, layout=QkvLayout(attend_until=True))
    with pytest.raises(TensorRTLoweringError, match="attend_until .* not implemented by the TensorRT plugin"):
        lower_for_tensorrt(ir.from_proto(model))
