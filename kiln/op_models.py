"""One-node ONNX models of kiln's ops, for their tests and benchmarks (onnx: the compile extra; the runtime never
loads this module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.contract import OP_DOMAIN

if TYPE_CHECKING:
    from onnx import ModelProto, NodeProto, TensorProto, ValueInfoProto


def single_node_model(node: NodeProto, name: str, inputs: list[ValueInfoProto], outputs: list[ValueInfoProto],
                      op_version: int = 1, initializers: list[TensorProto] | None = None) -> ModelProto:
    """A one-node ONNX model of one of kiln's ops (opset 18 beside the kiln domain, IR 8: what ONNX Runtime 1.21
    loads), for the ops' tests and benchmarks."""
    from onnx import helper  # compile-time dependency only

    graph = helper.make_graph([node], name, inputs, outputs, initializers or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(OP_DOMAIN, op_version)])
    model.ir_version = 8
    return model
