"""kiln.AllReduce: the numpy reference, and the ONNX Runtime CPU kernel (libkiln_ops.so) against it with one
session per rank on threads sharing one workspace (what the rank processes share through shared memory): every
rank's output bit for bit the rank-ordered float32 sum over many calls (both buffers), the wait statistics, and
the failures that must not hang: a rank that never arrives (timeout), the abort word, mismatched shapes, a
tensor larger than the slots, an uninitialised workspace."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kiln import all_reduce
from kiln.all_reduce import OP_TYPE, OP_VERSION, WORKSPACE_INPUT, all_reduce_ref, init_workspace, workspace_bytes
from kiln.contract import OP_DOMAIN

ort = pytest.importorskip("onnxruntime")
from op_library import op_library_or_skip  # noqa: E402

LIBRARY = op_library_or_skip()


def make_single_op_model(rank: int, world_size: int):
    """A one-node ONNX model y = kiln.AllReduce(x, tp_workspace), x float32 [T, H]."""
    from onnx import TensorProto, helper

    node = helper.make_node(OP_TYPE, ["x", WORKSPACE_INPUT], ["y"], domain=OP_DOMAIN, rank=rank,
                            world_size=world_size)
    graph = helper.make_graph([node], "all_reduce",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "H"]),
                               helper.make_tensor_value_info(WORKSPACE_INPUT, TensorProto.UINT8, ["W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", "H"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(OP_DOMAIN, OP_VERSION)])
    model.ir_version = 8
    return model


def session(rank: int, world: int):
    so = ort.SessionOptions()
    so.register_custom_ops_library(LIBRARY)
    so.intra_op_num_threads = 1
    model = make_single_op_model(rank, world).SerializeToString()
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def workspace(world: int, max_elements: int, timeout_ms: int = 20000) -> np.ndarray:
    buffer = np.zeros(workspace_bytes(world, max_elements), dtype=np.uint8)
    init_workspace(buffer, world, timeout_ms)
    return buffer


def run_group(world: int, inputs: list[list[np.ndarray]], buffer: np.ndarray) -> list[list[object]]:
    """Rank r runs inputs[r] call after call on its own thread; each result is an array or the exception."""
    results: list[list[object]] = [[] for _ in range(world)]

    def rank_loop(rank: int) -> None:
        sess = session(rank, world)
        for x in inputs[rank]:
            try:
                results[rank].append(sess.run(None, {"x": x, WORKSPACE_INPUT: buffer})[0])
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                results[rank].append(exc)
                return

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


def test_reference_adds_in_rank_order_in_float32():
    parts = [np.array([1e8, 1.0], dtype=np.float32), np.array([-1e8, 1.0], dtype=np.float32),
             np.array([1.0, 1e-8], dtype=np.float32)]
    np.testing.assert_array_equal(all_reduce_ref(parts), np.array([1.0, 2.0], dtype=np.float32))
    assert all_reduce_ref(parts[::-1])[0] == 0.0  # (1 - 1e8) + 1e8 rounds away the 1: the order is the contract
    with pytest.raises(ValueError, match="same shape"):
        all_reduce_ref([np.zeros(2, np.float32), np.zeros(3, np.float32)])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_gets_the_rank_ordered_sum_bit_for_bit(world):
    rng = np.random.default_rng(world)
    shapes = [(16, 576), (1, 576), (37, 64), (5, 576), (0, 576), (16, 576)]  # several calls: both buffers, reused
    inputs = [[(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for s in shapes]
              for _ in range(world)]
    buffer = workspace(world, 37 * 576)
    results = run_group(world, inputs, buffer)
    for call in range(len(shapes)):
        want = all_reduce_ref([inputs[r][call] for r in range(world)])
        for rank in range(world):
            got = results[rank][call]
            assert isinstance(got, np.ndarray), got
            np.testing.assert_array_equal(got, want)
    for rank in range(world):
        stats = all_reduce.rank_stats(buffer, rank)
        assert stats["calls"] == len(shapes) and stats["bytes"] == sum(4 * int(np.prod(s)) for s in shapes)
        assert stats["pid"] > 0 and stats["wait_ns"] >= 0


def test_a_rank_that_never_arrives_is_a_timeout_not_a_hang():
    buffer = workspace(2, 64, timeout_ms=300)
    x = np.ones((2, 8), dtype=np.float32)
    results = run_group(2, [[x], []], buffer)
    assert isinstance(results[0][0], Exception)
    assert "rank 0 waited" in str(results[0][0]) and "for rank(s) 1" in str(results[0][0])
    assert all_reduce.header_words(buffer)[all_reduce.W_ABORT] == 1  # the group is done: others fail at once
    again = run_group(2, [[], [x]], buffer)
    assert "aborted" in str(again[1][0])


def test_the_abort_word_stops_a_waiting_rank():
    buffer = workspace(2, 64)
    x = np.ones((2, 8), dtype=np.float32)
    timer = threading.Timer(0.2, all_reduce.set_abort, args=(buffer,))
    timer.start()
    results = run_group(2, [[x], []], buffer)
    timer.join()
    assert "aborted while this rank waited" in str(results[0][0])


def test_ranks_reducing_different_sizes_fail_naming_the_mismatch():
    buffer = workspace(2, 64)
    results = run_group(2, [[np.ones((2, 8), np.float32)], [np.ones((3, 8), np.float32)]], buffer)
    assert any("the ranks' graphs do not match" in str(r[0]) for r in results)


def test_a_tensor_larger_than_the_slots_and_a_bare_workspace_are_refused():
    buffer = workspace(1, 16)
    with pytest.raises(Exception, match=r"x \[4, 8\] \(128 bytes\) is larger than the workspace's slots"):
        session(0, 1).run(None, {"x": np.ones((4, 8), np.float32), WORKSPACE_INPUT: buffer})
    bare = np.zeros(workspace_bytes(1, 16), dtype=np.uint8)
    with pytest.raises(Exception, match="not initialised for a group of 1 ranks"):
        session(0, 1).run(None, {"x": np.ones((2, 8), np.float32), WORKSPACE_INPUT: bare})


def test_a_rank_outside_the_group_is_refused_at_load():
    with pytest.raises(Exception, match=r"rank 2 is not in \[0, world_size 2\)"):
        session(2, 2)
