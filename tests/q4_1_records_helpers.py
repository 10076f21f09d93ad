"""Checks of kiln.MatMulQ4_1's and kiln.MoE's Q4_1 records in built engines (optimize/pack_q4_1_records.py), for tests
only: the graph holds records on page boundaries of its data file, and computes bit for bit what the same graph with
its weights unpacked into blocks computes (the layout engines had before records; the kernels pack those at load)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from kiln import moe
from kiln.matmul_q4_1 import OP_TYPE, RECORDS, node_layout
from kiln.optimize._common import PAGE_BYTES, write_weights
from kiln.optimize.pack_q4_1_records import unpack_q4_1_records

PROMPT = list(range(3, 43))


def q4_1_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in graph.node if n.op_type == OP_TYPE and n.domain == "kiln"]


def q4_1_moe_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The kiln.MoE nodes with Q4_1 experts (their dm inputs: float and GGUF experts have none)."""
    return [n for n in graph.node if n.op_type == moe.OP_TYPE and n.domain == "kiln" and len(n.input) == 6]


def assert_records_on_pages(graph_path: Path) -> None:
    """Every kiln.MatMulQ4_1 and Q4_1 kiln.MoE of the graph reads records, each starting on a page of the data file."""
    graph = onnx.load(str(graph_path), load_external_data=False).graph
    nodes, moe_nodes = q4_1_nodes(graph), q4_1_moe_nodes(graph)
    assert nodes and all(node_layout(n) == RECORDS for n in nodes)
    assert all(node_layout(n) == RECORDS for n in moe_nodes)
    offsets = {t.name: int(next(e.value for e in t.external_data if e.key == "offset"))
               for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    records = [n.input[1] for n in nodes] + [name for n in moe_nodes for name in n.input[2:4]]
    assert all(offsets[name] % PAGE_BYTES == 0 for name in records)


def blocks_copy(graph_path: Path, out: Path) -> Path:
    """The graph with every kiln.MatMulQ4_1's records unpacked into blocks, written with its own data file into out."""
    model = onnx.load(str(graph_path), load_external_data=False)
    unpack_q4_1_records(model.graph, graph_path.parent)
    out.mkdir()
    write_weights(model.graph, graph_path.parent, out / "model.onnx.data", "model.onnx.data", inline_limit=1024)
    onnx.save(model, str(out / "model.onnx"))
    return out / "model.onnx"


def prompt_logits(graph_path: Path) -> np.ndarray:
    """Every row's logits of a prompt in two chunks, then two decode steps' (one thread)."""
    from engine_driver import PagedDriver

    driver = PagedDriver(graph_path, threads=1, num_blocks=8)
    prefill = driver.step([(0, PROMPT[:25])], all_rows=True)
    return np.concatenate([prefill, driver.step([(0, PROMPT[25:])], all_rows=True)] +
                          [driver.step([(0, [token])]) for token in (7, 11)])


def assert_records_compute_the_blocks_logits(engine: Path, tmp_path: Path) -> None:
    assert_records_on_pages(engine / "model.onnx")
    blocks = blocks_copy(engine / "model.onnx", tmp_path / "blocks")
    np.testing.assert_array_equal(prompt_logits(engine / "model.onnx"), prompt_logits(blocks))
