"""quantize_embedding(file_blocks=True): a GGUF's Q8_0 and Q6_K embedding tables become GatherBlockQuantized tables
holding the file's own numbers, which ONNX Runtime gathers exactly (gguf-py's dequantized rows, bit for bit); other
types' tables keep the 8-bit blocks of every scheme."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from kiln.export.lazy_initializers import BlockRows
from kiln.export.tensor_files import FileBlocks
from kiln.gguf_blocks import GgmlType, dequantize, random_blocks
from kiln.optimize.quantize_embedding import quantize_embedding

ort = pytest.importorskip("onnxruntime")


def gather_model(kind: GgmlType, rows: int = 10, cols: int = 512) -> tuple[ir.Model, np.ndarray]:
    blocks = random_blocks(np.random.default_rng(int(kind)), kind, rows, cols, std=0.5)
    table = dequantize(blocks, kind)
    ids = ir.Value(name="ids", shape=ir.Shape([3]), type=ir.TensorType(ir.DataType.INT64))
    weight = ir.Value(name="table", shape=ir.Shape([rows, cols]), type=ir.TensorType(ir.DataType.FLOAT))
    weight.const_value = BlockRows(lambda: table, (rows, cols), name="table",
                                   blocks=(FileBlocks(int(kind), rows, lambda: blocks),))
    gather = ir.node("Gather", [weight, ids], attributes={"axis": 0})
    gather.outputs[0].name = "rows"
    graph = ir.Graph([ids], [gather.outputs[0]], nodes=[gather], initializers=[weight], opset_imports={"": 18})
    return ir.Model(graph, ir_version=8), table


@pytest.mark.parametrize("kind", [GgmlType.Q8_0, GgmlType.Q6_K, GgmlType.Q4_K], ids=lambda t: t.name)
def test_file_tables_gather_their_own_numbers(kind):
    model, table = gather_model(kind)
    assert quantize_embedding(model, file_blocks=True) == 1
    node = next(iter(model.graph))
    assert node.op_type == "GatherBlockQuantized"
    block = node.attributes["block_size"].as_int()
    assert block == {GgmlType.Q8_0: 32, GgmlType.Q6_K: 16, GgmlType.Q4_K: 32}[kind]
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([7, 0, 9], np.int64)
    got = session.run(None, {"ids": ids})[0]
    if kind == GgmlType.Q4_K:  # no integer zero point for its minimums: the 8-bit blocks, a half step off at most
        assert 0 < np.abs(got - table[ids]).max() < np.abs(table).max() / 255
    else:
        np.testing.assert_array_equal(got, table[ids])


def test_q4_1_file_rows_decode_to_the_codes_gguf_py_dequantizes():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    from kiln.optimize.quantize_gguf import q4_1_weights

    w = np.random.default_rng(4).standard_normal((6, 96)).astype(np.float32)
    data = gguf_quantize(w, GGMLQuantizationType.Q4_1)
    expected = gguf_dequantize(data, GGMLQuantizationType.Q4_1).reshape(6, 96)
    np.testing.assert_array_equal(q4_1_weights(data).dequantize(), expected)


def test_q4_0_file_rows_are_q4_1_codes_of_the_same_weights():
    """Q4_0's w = d (q - 8) as Q4_1 codes with minimum -8 d: gguf-py's dequantized weights exactly; a step whose -8 d
    is no float16 is refused (None: the linear keeps its Q4_0 blocks)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    from kiln.optimize.quantize_gguf import q4_0_as_q4_1

    w = np.random.default_rng(5).standard_normal((6, 96)).astype(np.float32)
    data = gguf_quantize(w, GGMLQuantizationType.Q4_0)
    expected = gguf_dequantize(data, GGMLQuantizationType.Q4_0).reshape(6, 96)
    codes = q4_0_as_q4_1(data)
    assert codes is not None
    np.testing.assert_array_equal(codes.dequantize(), expected)
    huge = data.copy()
    huge[0, 0:2] = np.array([9000], np.float16).view(np.uint8)  # -8 d = -72000: past float16
    assert q4_0_as_q4_1(huge) is None
