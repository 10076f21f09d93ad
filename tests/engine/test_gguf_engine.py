"""`kiln build FILE.gguf --quantization gguf | gguf-exact`: a tiny llama GGUF of k-quant blocks mixed as Q4_K_M mixes
them (Q4_K, with Q6_K / Q5_K attn_v, Q6_K / Q8_0 ffn_down, a Q6_K head: its own or the tied table's) keeps every
linear in its file's blocks (kiln.MatMulGGUF, the engine's bytes the file's, q/k rows unpermuted whole). gguf-exact
gives the logits of the file's dequantized weights (the same file built with --quantization none) within 1e-3, a
float32 KV cache in all (float16's rounding steps would turn float32 differences of 1e-7 into 1e-3 at an unlucky
value); gguf (int8 activations) closer to them than the file re-rounded to Q4_1 (int4-q4_1) gets."""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest
import torch
from engine_driver import PagedDriver
from onnx import numpy_helper
from tiny_gguf import make_tiny_gguf

from kiln.contract import GGUF_RECORDS_ABI, MORE_RECORDS_ABI
from kiln.gguf_blocks import GgmlType, random_blocks
from kiln.gguf_records import unpack_q4_k_records
from kiln.manifest import BuildOptions, read_manifest
from kiln.matmul_q4_1 import node_layout
from kiln.quant_scheme import QuantScheme

pytest.importorskip("gguf")

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
PROMPT = [5, 77, 190, 33, 250, 12, 8, 99, 140, 201, 64, 3, 17, 222, 180, 45, 71, 300, 9, 128] * 2
# blk.{layer}.{part} -> type (Q4_K when not listed); the head and the embedding table by their own names
MIX = {"blk.0.attn_v": GgmlType.Q6_K, "blk.1.attn_v": GgmlType.Q5_K, "blk.0.ffn_down": GgmlType.Q6_K,
       "blk.1.ffn_down": GgmlType.Q8_0, "output": GgmlType.Q6_K, "token_embd": GgmlType.Q8_0,
       "blk.1.ffn_up": GgmlType.Q4_0}


def _quantize(name: str, array: np.ndarray, tied: bool):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    base = name.rsplit(".", 1)[0]
    kind = GgmlType.Q6_K if tied and base == "token_embd" else MIX.get(base, GgmlType.Q4_K)  # llama.cpp's choice
    std = 0.5 if base == "token_embd" else 1 / np.sqrt(array.shape[1])
    return kind, random_blocks(rng, kind, array.shape[0], array.shape[1], std)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def gguf_engines(request, tmp_path_factory):
    """Untied: a Q6_K head and a Q8_0 table; tied: the head reads the Q6_K table's blocks."""
    from kiln.optimize.build import build_engine

    tied = request.param
    folder = tmp_path_factory.mktemp("gguf-k")
    path, _ = make_tiny_gguf(folder, "llama", quantize=lambda name, array: _quantize(name, array, tied),
                             tie_word_embeddings=tied, **SHAPE)
    engines = {}
    # a float32 KV cache: float16's rounding would amplify float32 differences
    for scheme in ("gguf", "gguf-exact", "int4-q4_1", "none"):
        engines[scheme] = folder / scheme
        build_engine(path, engines[scheme], BuildOptions(quantization=QuantScheme.parse(scheme), kv_dtype="float32"),
                     progress=lambda _msg: None)
    return path, engines


def _logits(engine) -> np.ndarray:
    driver = PagedDriver(engine / "model.onnx", threads=2, num_blocks=16)
    rows = [driver.step([(0, PROMPT[:25])], all_rows=True), driver.step([(0, PROMPT[25:])], all_rows=True)]
    rows += [driver.step([(0, [token])]) for token in (11, 200, 47)]  # decode rows
    return np.concatenate(rows)


def test_gguf_exact_engine_gives_the_files_dequantized_logits(gguf_engines):
    _, engines = gguf_engines
    exact, kept = _logits(engines["none"]), _logits(engines["gguf-exact"])
    assert np.abs(exact).max() > 1  # logits of some size: the tolerance below means something
    assert np.abs(kept - exact).max() < 1e-3


def test_gguf_engine_with_int8_activations_is_closer_to_the_file_than_re_rounding(gguf_engines):
    """int8 activations on the file's own weights against the file re-rounded to Q4_1 (which has int8 activations
    too): on random k-quant blocks (uncentred sub-blocks, the hard case) gguf's logits stay nearer the dequantized
    file's, mean and worst row alike; a misplaced scale or minimum would be far past the re-rounding's error."""
    _, engines = gguf_engines
    exact = _logits(engines["none"])
    int8, q4_1 = (np.abs(_logits(engines[scheme]) - exact) for scheme in ("gguf", "int4-q4_1"))
    assert 0 < int8.mean() < 0.8 * q4_1.mean(), (int8.mean(), q4_1.mean())
    assert int8.max(-1).mean() < q4_1.max(-1).mean()


def test_every_linear_is_the_files_blocks(gguf_engines):
    from gguf import GGUFReader

    from kiln.export.tensor_files import unpermute_rotary_rows

    path, engines = gguf_engines
    model = onnx.load(engines["gguf"] / "model.onnx")
    nodes = [n for n in model.graph.node if n.op_type == "MatMulGGUF"]
    types = sorted(GgmlType(n.attribute[0].i).name for n in nodes)
    assert all(n.attribute[1].name == "int8_activations" and n.attribute[1].i == 1 for n in nodes)
    exact = [n for n in onnx.load(engines["gguf-exact"] / "model.onnx").graph.node if n.op_type == "MatMulGGUF"]
    assert len(exact) == len(nodes) and all(n.attribute[1].i == 0 for n in exact)
    # per layer: fused q/k (Q4_K) + v (Q6_K / Q5_K) as two nodes, o, gate/up (Q4_K, or Q4_K + Q4_0), down; the head
    assert types.count("Q6_K") == 3 and types.count("Q5_K") == 1 and types.count("Q8_0") == 1
    assert types.count("Q4_0") == 1 and types.count("Q4_K") == 6
    assert not [n for n in model.graph.node if n.op_type in ("MatMul", "MatMulNBits")]
    inits = {i.name: i for i in model.graph.initializer}
    reader = GGUFReader(str(path))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    file_rows = np.asarray(q.data).reshape(256, -1)
    # the Q4_K, Q5_K, Q6_K and Q8_0 nodes hold records (the file's bytes in the kernel's layout; Q8_0's down has
    # K = 512, whole superblocks), every other type the file's blocks
    records = (GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K, GgmlType.Q8_0)
    assert all((node_layout(n) == "records") == (GgmlType(n.attribute[0].i) in records) for n in nodes)
    assert all(node_layout(n) == "blocks" for n in exact)
    assert read_manifest(engines["gguf"]).op_library_abi == MORE_RECORDS_ABI
    assert read_manifest(engines["gguf-exact"]).op_library_abi == GGUF_RECORDS_ABI - 2  # nothing of 11 to 14
    fused = next(n for n in nodes if n.input[1].endswith("fused.q4_k.rows0.records"))  # layer 0's q/k, first in order
    records = numpy_helper.to_array(inits[fused.input[1]], base_dir=str(engines["gguf"]))
    engine_rows = unpack_q4_k_records(records)[:256]
    expected = unpermute_rotary_rows(torch.from_numpy(file_rows.copy()), 4).numpy()
    np.testing.assert_array_equal(engine_rows, expected)


def test_kiln_build_defaults_to_gguf_for_a_file_of_executable_blocks(tmp_path):
    """A llama.cpp user's Q4_K_M file runs as it is unless told otherwise; F32 matrices (and SmolLM2's Q4_1 file,
    `default`) keep `none`."""
    from kiln.optimize.quantize_gguf import default_quantization

    quantized, _ = make_tiny_gguf(tmp_path / "k", "llama", quantize=lambda name, array: _quantize(name, array, False),
                                  **SHAPE)
    plain, _ = make_tiny_gguf(tmp_path / "f32", "llama", **SHAPE)
    assert default_quantization(str(quantized)) == "gguf"
    assert default_quantization(str(plain)) == "none"
    assert default_quantization("default") == "none"
