"""kiln bench's bandwidth floor counts the bytes a decode step reads, not the engine's file sizes."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.optimize.weight_bytes import graph_bytes_per_token, node_bytes_per_token


def _graph(nodes, arrays):
    inits = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_graph(nodes, "g", [x], [y], inits)


def test_a_gathered_table_is_read_one_row_a_token():
    arrays = {"table": np.zeros((100, 8), np.float32), "w": np.zeros((8, 8), np.float32)}
    graph = _graph([helper.make_node("Gather", ["table", "ids"], ["e"]),
                    helper.make_node("MatMul", ["x", "w"], ["y"])], arrays)
    assert graph_bytes_per_token(graph) == 8 * 8 * 4


def test_block_quantized_table_with_its_scales_is_not_counted():
    arrays = {"t.q8": np.zeros((100, 32), np.uint8), "t.scales": np.zeros((100, 1), np.float32),
              "t.zp": np.zeros((100, 1), np.uint8), "w": np.zeros((8, 8), np.float32)}
    gather = helper.make_node("GatherBlockQuantized", ["t.q8", "ids", "t.scales", "t.zp"], ["e"],
                              domain="com.microsoft", block_size=32, bits=8)
    graph = _graph([gather, helper.make_node("MatMul", ["x", "w"], ["y"])], arrays)
    assert graph_bytes_per_token(graph) == 8 * 8 * 4


def test_a_table_also_used_as_the_tied_head_is_counted_once():
    arrays = {"table": np.zeros((100, 8), np.float32)}
    graph = _graph([helper.make_node("Gather", ["table", "ids"], ["e"]),
                    helper.make_node("Gemm", ["x", "table"], ["y"], transB=1)], arrays)
    assert graph_bytes_per_token(graph) == 100 * 8 * 4


def test_moe_experts_count_top_k_of_e():
    e, f, d = 8, 4, 8
    arrays = {"router": np.zeros((e, d), np.float32), "gate_up": np.zeros((e, 2 * f, d), np.float32),
              "down": np.zeros((e, d, f), np.float32)}
    moe = helper.make_node("MoE", ["x", "router", "gate_up", "down"], ["y"], domain="kiln", top_k=2,
                           norm_topk_prob=0)
    graph = _graph([moe], arrays)
    assert graph_bytes_per_token(graph) == e * d * 4 + (2 / e) * (e * 2 * f * d + e * d * f) * 4


def test_external_data_lengths_are_read_without_loading_the_data(tmp_path):
    w = np.ones((64, 64), np.float32)
    model = helper.make_model(_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], {"w": w}))
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    graph = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph
    assert graph.initializer[0].external_data and graph_bytes_per_token(graph) == w.nbytes


def test_node_bytes_are_each_nodes_reads_a_shared_table_for_each():
    """profile_ops --nodes sets each node's time against its own reads: the gathered table reads nothing whole, the
    tied head all of it, a MoE node top_k of its experts."""
    e, f, d = 8, 4, 8
    arrays = {"table": np.zeros((100, 8), np.float32), "router": np.zeros((e, d), np.float32),
              "gate_up": np.zeros((e, 2 * f, d), np.float32), "down": np.zeros((e, d, f), np.float32)}
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
             helper.make_node("MoE", ["x", "router", "gate_up", "down"], ["h"], name="moe", domain="kiln", top_k=2,
                              norm_topk_prob=0),
             helper.make_node("Gemm", ["h", "table"], ["y"], name="head", transB=1)]
    reads = node_bytes_per_token(_graph(nodes, arrays))
    assert reads == {"embed": 0, "moe": e * d * 4 + (2 / e) * (e * 2 * f * d + e * d * f) * 4, "head": 100 * 8 * 4}
