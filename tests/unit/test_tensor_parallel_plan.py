"""How kiln/tensor_parallel.py gives heads and MLP columns to ranks: KV heads divided when they divide, replicated
when the ranks are a multiple of them, whole GQA groups unevenly otherwise (rank 0, which also runs the LM head,
the fewer), refused when none applies; MLP columns balancing each rank's weights; the manifest's check of the
ranks; and what the split refuses before reading a graph (weights other than float32 and Q4_1, int8 KV, stages)."""

import dataclasses
from pathlib import Path

import pytest

from kiln.manifest import BACKEND_ORT_CPU, BuildOptions
from kiln.optimize.shard_tensor_parallel import check_splittable
from kiln.quant_scheme import QuantScheme
from kiln.spec import ModelSpec
from kiln.tensor_parallel import (
    ShardShape,
    TensorParallelError,
    TensorRank,
    check_ranks,
    column_ranges,
    head_ranges,
    plan_ranks,
)

SMOLLM2 = ShardShape(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536,
                     vocab_size=49152, num_layers=30)


def spans(ranges):
    return [(q.start, q.stop, kv.start, kv.stop) for q, kv in ranges]


def test_kv_heads_divided_when_the_ranks_divide_them():
    assert spans(head_ranges(9, 3, 3)) == [(0, 3, 0, 1), (3, 6, 1, 2), (6, 9, 2, 3)]
    assert spans(head_ranges(32, 8, 4)) == [(0, 8, 0, 2), (8, 16, 2, 4), (16, 24, 4, 6), (24, 32, 6, 8)]


def test_kv_heads_replicated_when_the_ranks_are_a_multiple_of_them():
    assert spans(head_ranges(4, 2, 4)) == [(0, 1, 0, 1), (1, 2, 0, 1), (2, 3, 1, 2), (3, 4, 1, 2)]
    assert spans(head_ranges(8, 1, 2)) == [(0, 4, 0, 1), (4, 8, 0, 1)]  # MQA: the one KV head on both


def test_whole_groups_unevenly_with_rank_0_taking_the_fewer():
    assert spans(head_ranges(9, 3, 2)) == [(0, 3, 0, 1), (3, 9, 1, 3)]
    assert spans(head_ranges(15, 5, 3)) == [(0, 3, 0, 1), (3, 9, 1, 3), (9, 15, 3, 5)]


def test_splits_that_fit_no_rule_are_refused():
    with pytest.raises(TensorParallelError, match="6 query heads in 2 KV groups do not split over 4"):
        head_ranges(6, 2, 4)
    with pytest.raises(TensorParallelError, match="9 query heads in 3 KV groups do not split over 5"):
        head_ranges(9, 3, 5)


def test_mlp_columns_balance_the_ranks_weights():
    heads = head_ranges(9, 3, 2)
    columns = column_ranges(SMOLLM2, heads)
    assert sum(len(c) for c in columns) == 1536 and all(len(c) % 32 == 0 for c in columns)
    d, h = SMOLLM2.head_dim, SMOLLM2.hidden_size
    weights = [h * d * (2 * len(q) + 2 * len(kv)) + 3 * h * len(c) for (q, kv), c in zip(heads, columns, strict=True)]
    weights[0] += h * SMOLLM2.vocab_size // SMOLLM2.num_layers
    assert abs(weights[0] - weights[1]) <= 3 * h * 32  # within one step of columns
    assert len(columns[0]) < len(columns[1])  # rank 0 carries the LM head
    tiny = dataclasses.replace(SMOLLM2, intermediate_size=64)
    assert [len(c) for c in column_ranges(tiny, heads)] == [32, 32]  # every rank keeps at least one step
    with pytest.raises(TensorParallelError, match="too few for 3 tensor-parallel ranks"):
        column_ranges(tiny, head_ranges(9, 3, 3))


def test_the_manifest_check_names_a_rank_whose_kv_heads_do_not_fit_its_heads():
    ranks = plan_ranks(SMOLLM2, 3)
    check_ranks(ranks, 9, 3)
    bad = (ranks[0], dataclasses.replace(ranks[1], first_kv_head=0), ranks[2])
    with pytest.raises(ValueError, match=r"rank1.onnx's KV heads \[0, 1\] are not those of its query heads"):
        check_ranks(bad, 9, 3)
    with pytest.raises(ValueError, match="end at head 6, but the model has 9 heads"):
        check_ranks(ranks[:2], 9, 3)
    with pytest.raises(ValueError, match="empty or negative MLP columns range"):
        TensorRank("rank0.onnx", 0, 3, 0, 1, 5, 5)


def _spec() -> ModelSpec:
    return ModelSpec(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                     max_position_embeddings=8192, tie_word_embeddings=True)


@pytest.mark.parametrize(("options", "message"), [
    (BuildOptions(quantization=QuantScheme.parse("int8-weight-only"), tensor_parallel=2),
     "splits float32 and int4-q4_1 engines only; this one has int8-weight-only weights"),
    (BuildOptions(kv_dtype="int8", tensor_parallel=2), "does not split int8 KV pools"),
    (BuildOptions(pipeline_stages=2, tensor_parallel=2), "pipeline stages or tensor-parallel ranks, not both"),
    (BuildOptions(tensor_parallel=5), "do not split over 5 tensor-parallel ranks"),
])
def test_what_the_split_refuses_before_reading_a_graph(options, message):
    with pytest.raises(TensorParallelError, match=message):
        check_splittable(BACKEND_ORT_CPU, options, _spec(), extras=False)
    with pytest.raises(TensorParallelError, match="Medusa heads or an image encoder"):
        check_splittable(BACKEND_ORT_CPU, BuildOptions(tensor_parallel=2), _spec(), extras=True)


def test_metrics_export_each_rank_time_and_the_all_reduce_waits_and_bytes():
    from prometheus_client import CollectorRegistry, generate_latest

    from kiln.runtime.outputs import EngineStats, RankTotals
    from kiln.runtime.server.metrics import _EngineCollector

    def scrape(stats: EngineStats) -> str:
        registry = CollectorRegistry()
        registry.register(_EngineCollector(lambda: stats))
        return generate_latest(registry).decode()

    text = scrape(EngineStats(tensor_parallel=RankTotals((1.5, 2.25), (0.5, 0.125), 4608, 3, 1)))
    assert 'kiln_tensor_parallel_rank_seconds_total{rank="0"} 1.5' in text
    assert 'kiln_tensor_parallel_rank_seconds_total{rank="1"} 2.25' in text
    assert 'kiln_tensor_parallel_all_reduce_wait_seconds_total{rank="1"} 0.125' in text
    assert "kiln_tensor_parallel_all_reduce_bytes_total 4608.0" in text
    assert "kiln_tensor_parallel_restarts_total 1.0" in text
    assert "kiln_tensor_parallel" not in scrape(EngineStats())


def test_replicas_rank_totals_sum_rank_by_rank():
    from kiln.runtime.outputs import RankTotals

    total = RankTotals() + RankTotals((1.0, 2.0), (0.5, 0.5), 100, 3, 1) + RankTotals((0.5, 0.25), (0.25, 0.0), 50, 1)
    assert total == RankTotals((1.5, 2.25), (0.75, 0.5), 150, 4, 1)


def test_a_rank_count_below_one_is_refused():
    from kiln.errors import InvalidParamError
    from kiln.runtime.params import RuntimeConfig

    with pytest.raises(InvalidParamError, match="tensor_parallel must be >= 1"):
        RuntimeConfig(tensor_parallel=0)


@pytest.mark.parametrize("layout", ["blocks", "records"])
def test_q4_1_slices_sum_to_the_whole_matmul(layout):
    """kiln.MatMulQ4_1 weights sliced by output channel and by whole input blocks: the ranks' outputs, concatenated
    or summed, are the spec's for the whole weight (the same activation blocks quantize alike); records slices are
    records again (16 channels a record: the columns below cut through groups)."""
    import numpy as np
    from onnx import helper, numpy_helper

    from kiln.matmul_q4_1 import Q4_1Weights, matmul_q4_1_ref
    from kiln.optimize.shard_weights import WeightReader, column_slices, row_slices

    rng = np.random.default_rng(3)
    n, k = 48, 160  # 5 blocks: the cuts below split the pairs of blocks qs stores together
    weights = Q4_1Weights(rng.integers(0, 16, (n, k), dtype=np.uint8),
                          (rng.random((n, k // 32)) * 0.1 + 0.01).astype(np.float16),
                          (rng.standard_normal((n, k // 32)) * 0.1).astype(np.float16))
    qs, dm = weights.pack_as(layout)
    attributes = {"layout": layout} if layout == "records" else {}
    node = helper.make_node("MatMulQ4_1", ["x", "qs", "dm"], ["y"], domain="kiln", **attributes)
    graph = helper.make_graph([node], "g", [], [], initializer=[numpy_helper.from_array(qs, "qs"),
                                                                numpy_helper.from_array(dm, "dm")])
    reader = WeightReader(graph, Path("."))
    x = rng.standard_normal((3, k)).astype(np.float32)
    whole = matmul_q4_1_ref(x, qs, dm, layout=layout)
    parts = [row_slices(node, range(a, b), reader) for a, b in ((0, 32), (32, 96), (96, 160))]
    summed = sum(matmul_q4_1_ref(x[:, a:b], p["qs"], p["dm"], layout=layout)
                 for (a, b), p in zip(((0, 32), (32, 96), (96, 160)), parts, strict=True))
    np.testing.assert_allclose(summed, whole, rtol=0, atol=1e-5)
    columns = np.array([5, 6, 40, 1, 17])
    part = column_slices(node, columns, reader)
    if layout == "records":
        assert part["qs"].shape == (1, 5, 320) and part["dm"].shape == (5, 0)
    np.testing.assert_array_equal(matmul_q4_1_ref(x, part["qs"], part["dm"], layout=layout), whole[:, columns])
    with pytest.raises(TensorParallelError, match="do not start and end on Q4_1 blocks of 32"):
        row_slices(node, range(16, 64), reader)
