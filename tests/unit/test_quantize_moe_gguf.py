"""optimize/quantize_moe_gguf.py: a kiln.MoE whose expert stacks carry a GGUF file's blocks gets those bytes and
types as its GGUF experts (each read once, nothing dequantized), and the rewritten graph computes moe_gguf_ref on the
activation path asked for (float32 for Q5_0 / Q5_1 experts, which have no int8 kernel); a layer with a type
kiln.MatMulGGUF lacks keeps its float32 experts."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from kiln.export.lazy_initializers import BlockRows
from kiln.export.tensor_files import FileBlocks
from kiln.gguf_blocks import GgmlType, random_blocks
from kiln.moe import make_single_op_model
from kiln.moe_gguf import gguf_experts, moe_gguf_ref
from kiln.optimize.quantize_moe import moe_nodes
from kiln.optimize.quantize_moe_gguf import keep_moe_gguf_experts

ort = pytest.importorskip("onnxruntime")
from test_quantize_moe import run  # noqa: E402

E, D, F = 4, 256, 256


def file_stack(rng, kind: int, rows: int, k: int, reads: list[str], name: str):
    """An expert stack [E, rows, k] as a file's blocks: (FileBlocks over its E * rows rows, the bytes; a type without
    kiln's decoder gets bytes of Q8_0's size, which the pass must not read)."""
    data = random_blocks(rng, GgmlType(kind) if kind in set(GgmlType) else GgmlType.Q8_0, E * rows, k)

    def read() -> np.ndarray:
        reads.append(name)
        return data

    return FileBlocks(int(kind), E * rows, read), data.reshape(E, rows, -1)


def graph_with_file_experts(rng, types: tuple[int, int, int], reads: list[str]):
    """A one-node kiln.MoE graph whose experts are lazy float stacks carrying their file blocks (a GGUF build's)."""
    gate, gate_bytes = file_stack(rng, types[0], F, D, reads, "gate")
    up, up_bytes = file_stack(rng, types[1], F, D, reads, "up")
    down, down_bytes = file_stack(rng, types[2], D, F, reads, "down")

    def never() -> np.ndarray:
        raise AssertionError("the float32 experts were read")

    model = ir.serde.deserialize_model(make_single_op_model(top_k=2, norm_topk_prob=True))
    graph = model.graph
    router = (rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32)
    stacks = {"router": ir.tensor(router, name="router"),
              "gate_up": BlockRows(never, (E, 2 * F, D), name="gate_up", blocks=(gate, up)),
              "down": BlockRows(never, (E, D, F), name="down", blocks=(down,))}
    for value in list(graph.inputs):
        if value.name in stacks:
            graph.inputs.remove(value)
            value.const_value = stacks[value.name]
            graph.register_initializer(value)
    return model, router, (gate_bytes, up_bytes, down_bytes)


@pytest.mark.parametrize("types, int8_asked, int8", [
    ((GgmlType.Q4_K, GgmlType.Q4_K, GgmlType.Q6_K), True, True),     # Q4_K_M's experts under gguf
    ((GgmlType.Q4_K, GgmlType.Q4_K, GgmlType.Q6_K), False, False),   # ... under gguf-exact
    ((GgmlType.Q4_K, GgmlType.Q4_K, GgmlType.Q5_0), True, False),    # a type without an int8 kernel: float32 acts
])
def test_file_blocks_become_gguf_experts_and_the_graph_computes_the_spec(types, int8_asked, int8):
    rng = np.random.default_rng(0)
    reads: list[str] = []
    model, router, stacks = graph_with_file_experts(rng, types, reads)
    counts = keep_moe_gguf_experts(model, int8_activations=int8_asked)
    assert (counts.kept, counts.float32) == (1, 0)
    assert sorted(reads) == ["down", "gate", "up"]  # each stack's bytes read once
    (node,) = moe_nodes(model)
    names = ("gate_type", "up_type", "down_type", "int8_activations")
    assert [node.attributes[name].value for name in names] == [*map(int, types), int(int8)]
    gate_up, down = (value.const_value.numpy() for value in node.inputs[2:4])
    np.testing.assert_array_equal(gate_up, np.concatenate(stacks[:2], axis=1))
    np.testing.assert_array_equal(down, stacks[2])
    x = rng.standard_normal((5, D)).astype(np.float32)
    want = moe_gguf_ref(x, router, gguf_experts(*stacks, types, int8), top_k=2, norm_topk_prob=True,
                        int8_activations=int8)
    np.testing.assert_allclose(run(model, x), want, rtol=0, atol=4e-6 * np.abs(want).max())


@pytest.mark.parametrize("down_type", [10, 11])  # Q2_K, Q3_K: no kiln.MatMulGGUF decoder
def test_a_type_kiln_does_not_decode_keeps_float32_experts(down_type):
    reads: list[str] = []
    model, _, _ = graph_with_file_experts(np.random.default_rng(1), (GgmlType.Q4_K, GgmlType.Q4_K, down_type), reads)
    counts = keep_moe_gguf_experts(model)
    assert (counts.kept, counts.float32) == (0, 1) and reads == []
    (node,) = moe_nodes(model)
    assert isinstance(node.inputs[2].const_value, BlockRows) and "gate_type" not in node.attributes
