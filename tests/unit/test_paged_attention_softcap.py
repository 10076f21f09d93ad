"""kiln.PagedAttention's per-layer attributes as Gemma 2 / 3 use them: the attention logit soft-cap (reference
against dense attention, the CPU kernel against the reference over every pool dtype, with a sliding window, a
non-default scale and head_dim 256), a graph without the attribute (it defaults to off), and a bad value."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from test_paged_attention_kernel import OpCase, check, make_case, model_session, reference, session

from kiln.paged_attention import PagedAttentionAttrs, make_single_op_model

CAP = 5.0  # small against the scores below (|s| up to ~20), so tanh bends them


def capped_case(kv_dtype: str, window: int = 0, head_dim: int = 32, softcap: float = CAP) -> OpCase:
    attrs = PagedAttentionAttrs(8, 2, scale=0.25, sliding_window=window, softcap=softcap)
    return OpCase(attrs, head_dim, 16, kv_dtype)


def large_scores(feeds: dict) -> dict:
    """Queries scaled so that scale * q.k spans tens: where the soft-cap changes the softmax."""
    return {**feeds, "query": feeds["query"] * 4.0}


def test_reference_soft_caps_the_scaled_scores():
    rng = np.random.default_rng(3)
    op = capped_case("float32")
    feeds = large_scores(make_case(rng, [(0, 7)], op))
    out, _ = reference(feeds, op)
    q = feeds["query"].reshape(7, 8, 32).astype(np.float64)
    k = feeds["key"].reshape(7, 2, 32).astype(np.float64)
    v = feeds["value"].reshape(7, 2, 32).astype(np.float64)
    expected = np.zeros((7, 8, 32))
    for i in range(7):
        for h in range(8):
            s = CAP * np.tanh(k[: i + 1, h // 4] @ q[i, h] * 0.25 / CAP)
            w = np.exp(s - s.max())
            expected[i, h] = (w / w.sum()) @ v[: i + 1, h // 4]
    np.testing.assert_allclose(out.reshape(7, 8, 32), expected, rtol=1e-5, atol=1e-6)
    uncapped, _ = reference(feeds, capped_case("float32", softcap=0.0))
    assert np.abs(uncapped - out).max() > 0.05  # the cap matters on these scores


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_kernel_soft_cap_matches_reference(window, kv_dtype):
    rng = np.random.default_rng(window + 1)
    op = capped_case(kv_dtype, window)
    feeds = large_scores(make_case(rng, [(0, 45), (300, 1), (130, 30)], op))
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


def test_kernel_soft_cap_at_head_dim_256():
    rng = np.random.default_rng(256)
    op = capped_case("float32", window=8, head_dim=256)
    feeds = large_scores(make_case(rng, [(0, 20), (40, 1), (9, 3)], op))
    out, pool = session(op).run(None, feeds)
    check(out, pool, *reference(feeds, op))


def test_graph_without_the_attribute_runs_uncapped():
    """Graphs written before the attribute existed carry none: the kernel treats that as off."""
    rng = np.random.default_rng(7)
    op = capped_case("float32", softcap=0.0)
    model = make_single_op_model(op.attrs, op.head_dim, op.block_size)
    assert all(a.name != "softcap" for a in model.graph.node[0].attribute)
    feeds = large_scores(make_case(rng, [(5, 6), (0, 3)], op))
    out, pool = model_session(model).run(None, feeds)
    check(out, pool, *reference(feeds, op))


def test_negative_soft_cap_is_a_clear_error():
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        PagedAttentionAttrs(4, 2, softcap=-1.0)
    op = capped_case("float32", softcap=0.0)
    model = make_single_op_model(op.attrs, op.head_dim, op.block_size)
    model.graph.node[0].attribute.append(helper.make_attribute("softcap", -2.0))
    feeds = make_case(np.random.default_rng(8), [(0, 3)], op)
    with pytest.raises(Exception, match="kiln.PagedAttention: softcap must be finite and >= 0"):
        model_session(model).run(None, feeds)
