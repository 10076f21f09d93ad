"""Each optimizer pass, before vs after in onnxruntime, on kiln's export and on transformers'.

Graphs: kiln's own export of a tiny llama (ReferenceModel traced), and the graph
torch.onnx.export(dynamo=True) makes of transformers' LlamaForCausalLM with sdpa (transformers'
default attention) and eager attention.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from kiln import contract
from kiln.optimize.flatten_inputs import flatten_inputs
from kiln.optimize.fuse_attention import ROTARY_COS, ROTARY_SIN, AttentionConfig, fuse_attention
from kiln.optimize.fuse_projections import fuse_projections
from kiln.optimize.fuse_rmsnorm import fuse_rmsnorm
from kiln.optimize.fuse_skip_rmsnorm import fuse_skip_rmsnorm
from kiln.optimize.fuse_swiglu import fuse_swiglu
from kiln.optimize.lower_onnxruntime import lower_for_onnxruntime
from kiln.optimize.pack_attention_inputs import pack_attention_inputs
from kiln.optimize.pipeline import optimize_model
from kiln.optimize.select_logits import select_logits
from kiln.paged_attention import NO_KV_SCALE, PACKED_QKV

LAYERS = 2
T = 13


@pytest.fixture(scope="module")
def kiln_raw(tmp_path_factory, tiny_model_dir):
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.onnx_export import export_onnx

    return export_onnx(load_checkpoint(tiny_model_dir), tmp_path_factory.mktemp("raw") / "raw.onnx")


def export_hf(path, attn_implementation: str):
    from helpers import tiny_hf_config
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config("llama", num_hidden_layers=LAYERS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, position_ids):
            return self.inner(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    tokens = torch.export.Dim("T", min=1, max=512)
    ids, pos = torch.zeros((1, 8), dtype=torch.int64), torch.arange(8)[None]
    program = torch.onnx.export(
        Logits(model).eval(), (ids, pos), input_names=["input_ids", "position_ids"], output_names=["logits"],
        dynamic_shapes={"input_ids": {1: tokens}, "position_ids": {1: tokens}}, dynamo=True, optimize=True,
    )
    program.save(str(path))
    return path


@pytest.fixture(scope="module", params=["kiln", "hf-sdpa", "hf-eager"])
def raw_graph(request, tmp_path_factory, kiln_raw):
    if request.param == "kiln":
        return kiln_raw
    impl = request.param.split("-")[1]
    return export_hf(tmp_path_factory.mktemp(request.param) / "raw.onnx", impl)


def run(model: ir.Model, feeds: dict, output: int = 0) -> np.ndarray:
    from kiln.runtime.ops import library_path

    ir.external_data.load_to_model(model)
    options = ort.SessionOptions()
    options.register_custom_ops_library(library_path())  # kiln.SwiGLU
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[output]


def feeds_2d(vocab: int, length: int = T, seed: int = 0) -> dict:
    ids = np.random.default_rng(seed).integers(0, vocab, length)
    return {"input_ids": ids[None], "position_ids": np.arange(length)[None]}


def vocab_of(model: ir.Model) -> int:
    return model.graph.outputs[0].shape[-1]


def op_counts(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


def is_weight(value: ir.Value) -> bool:
    """A constant, or a constant seen through Transpose (the tied LM head)."""
    node = value.producer()
    if node is not None and node.op_type == "Transpose":
        return is_weight(node.inputs[0])
    return ir.convenience.get_const_tensor(value) is not None or value.is_initializer()


def test_flatten_inputs(raw_graph):
    before, after = ir.load(raw_graph), ir.load(raw_graph)
    assert flatten_inputs(after) == 2
    assert [v.shape.rank() for v in after.graph.inputs[:2]] == [1, 1]
    feeds = feeds_2d(vocab_of(before))
    flat = {name: value[0] for name, value in feeds.items()}
    np.testing.assert_allclose(run(after, flat), run(before, feeds), atol=1e-5, rtol=0)


def test_fuse_rmsnorm(raw_graph):
    before, after = ir.load(raw_graph), ir.load(raw_graph)
    assert fuse_rmsnorm(after) == 2 * LAYERS + 1
    counts = op_counts(after)
    assert counts["SimplifiedLayerNormalization"] == 2 * LAYERS + 1
    assert counts["ReduceMean"] == 0 and counts["Sqrt"] == 0
    feeds = feeds_2d(vocab_of(before))
    np.testing.assert_allclose(run(after, feeds), run(before, feeds), atol=1e-4, rtol=0)


def test_fuse_skip_rmsnorm(raw_graph):
    before, after = ir.load(raw_graph), ir.load(raw_graph)
    fuse_rmsnorm(after)
    # every norm but the first (it reads the embedding, not a residual sum) takes its Add along
    assert fuse_skip_rmsnorm(after) == 2 * LAYERS
    assert op_counts(after)["SkipSimplifiedLayerNormalization"] == 2 * LAYERS
    feeds = feeds_2d(vocab_of(before))
    np.testing.assert_allclose(run(after, feeds), run(before, feeds), atol=1e-4, rtol=0)


@pytest.mark.parametrize("fused_norm", [False, True])
def test_select_logits(raw_graph, fused_norm):
    """Backend-neutral: the gather sits before the final norm as the export wrote it (x * rsqrt(mean(x^2) + eps)
    * w, every read of x) or as one fused op, so the norm and the LM head see only those rows, squeezed to
    [L, D] there: the head writes the logits output itself (no Squeeze copying [L, V] after it)."""
    before, after = ir.load(raw_graph), ir.load(raw_graph)
    if fused_norm:
        fuse_rmsnorm(after)
    assert select_logits(after) == 1
    assert after.graph.outputs[0].name == contract.LOGITS
    head = after.graph.outputs[0].producer()
    assert head.op_type == "MatMul"
    squeeze = next(n for n in after.graph if n.op_type == "Squeeze" and n.inputs[0].producer().op_type == "Gather")
    residual = squeeze.inputs[0].producer().inputs[0]
    assert residual.producer().op_type == "Add"  # the last residual sum, read by nothing else now
    assert [u.node.op_type for u in residual.uses()] == ["Gather"]
    readers = sorted(u.node.op_type for u in squeeze.outputs[0].uses())
    assert readers == (["SimplifiedLayerNormalization"] if fused_norm else ["Mul", "Pow"])
    if not fused_norm:  # the backends' norm fusion still finds the final norm, on the gathered rows
        assert fuse_rmsnorm(after) == 2 * LAYERS + 1
        assert head.inputs[0].producer().inputs[0] is squeeze.outputs[0]
    feeds = feeds_2d(vocab_of(before))
    rows = np.array([T - 1, 0, 5], dtype=np.int64)
    full = run(before, feeds)[0]
    selected = run(after, {**feeds, contract.LOGITS_INDICES: rows})
    assert selected.shape == (3, vocab_of(before))
    np.testing.assert_allclose(selected, full[rows], atol=1e-4, rtol=0)


def test_select_logits_gathers_before_the_head_without_a_norm():
    """An LM head reading a value that is not a per-row computation of one activation: the gather goes
    right before the head."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 6], rng.standard_normal((4, 6)).astype(np.float32).ravel())
    nodes = [helper.make_node("Add", ["a", "b"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["y"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "T", 4]) for n in ("a", "b")]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 6])
    proto = helper.make_model(helper.make_graph(nodes, "g", io, [out], [w]),
                              opset_imports=[helper.make_opsetid("", 18)])
    model = ir.from_proto(proto)
    assert select_logits(model) == 1
    head = model.graph.outputs[0].producer()
    assert head.inputs[0].producer().op_type == "Squeeze" and op_counts(model)["Add"] == 1
    feeds = {n: rng.standard_normal((1, 5, 4)).astype(np.float32) for n in ("a", "b")}
    rows = np.array([4, 1], dtype=np.int64)
    full = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0][0]
    np.testing.assert_allclose(run(model, {**feeds, contract.LOGITS_INDICES: rows}), full[rows], atol=1e-5)


def test_fuse_projections(raw_graph):
    """q/k/v and gate/up become one MatMul each over the concatenated weight; nothing else changes."""
    before, after = ir.load(raw_graph), ir.load(raw_graph)
    assert fuse_projections(after) == 2 * LAYERS
    ops = op_counts(after)
    assert ops["MatMul"] == op_counts(before)["MatMul"] - 3 * LAYERS and ops["Split"] == 2 * LAYERS
    widths = sorted(n.inputs[0].shape[-1] for n in after.graph if n.op_type == "Split")
    assert widths == [16 * (4 + 2 + 2)] * LAYERS + [2 * 128] * LAYERS  # q + k + v; gate + up (tiny config)
    assert fuse_projections(after) == 0  # nothing left to fuse
    feeds = feeds_2d(vocab_of(before))
    np.testing.assert_allclose(run(after, feeds), run(before, feeds), atol=1e-5, rtol=0)


def test_fuse_swiglu(raw_graph):
    """After the gate/up fusion, each layer's Split -> silu(gate) * up becomes one kiln.SwiGLU."""
    before, after = ir.load(raw_graph), ir.load(raw_graph)
    fuse_projections(before)
    fuse_projections(after)
    assert fuse_swiglu(after) == LAYERS
    ops = op_counts(after)
    assert ops["SwiGLU"] == LAYERS and ops["Split"] == LAYERS and ops["Sigmoid"] == 0  # the q/k/v Splits stay
    assert ops["Mul"] == op_counts(before)["Mul"] - 2 * LAYERS
    for node in after.graph:
        if node.op_type == "SwiGLU":
            assert node.domain == contract.OP_DOMAIN
            assert node.inputs[0].producer().op_type == "MatMul"  # the fused gate/up projection
            assert node.outputs[0].uses()[0].node.op_type == "MatMul"  # the down projection
    assert fuse_swiglu(after) == 0
    feeds = feeds_2d(vocab_of(before))
    np.testing.assert_allclose(run(after, feeds), run(before, feeds), atol=1e-5, rtol=0)


def test_neutral_graph_lowers_for_tensorrt_with_nothing_to_unfuse(kiln_raw):
    """The neutral graph lowered for TensorRT: the attention split into its plugins, and nothing else to do:
    no ONNX Runtime op was ever made (norms and silu as the export wrote them)."""
    import onnx

    from kiln.optimize.lower_tensorrt import PLUGIN_DOMAIN, lower_for_tensorrt

    model = ir.load(kiln_raw)
    optimize_model(model)
    before = op_counts(model)
    assert lower_for_tensorrt(model) == {"paged_attention": LAYERS}
    assert {n.domain for n in model.graph} <= {"", PLUGIN_DOMAIN}
    ops = op_counts(model)
    assert ops["ReduceMean"] == before["ReduceMean"] == 2 * LAYERS + 1 and ops["Sigmoid"] == LAYERS
    assert ops["SimplifiedLayerNormalization"] == ops["SwiGLU"] == 0
    ir.external_data.load_to_model(model)
    onnx.checker.check_model(ir.to_proto(model))


def test_linears_name_their_modules_after_fusion(kiln_raw):
    """The int4 pass finds an AWQ artifact's int8-fallback linears by module name: the exporter's metadata,
    carried onto the fused q/k/v and gate/up MatMuls; the order is calibration/sensitivity.py's units."""
    from kiln.calibration.sensitivity import units
    from kiln.optimize.quant.graph import find_linears, is_lm_head, linear_modules

    after = ir.load(kiln_raw)
    fuse_projections(after)
    modules = [linear_modules(lin.matmul) for lin in find_linears(after) if not is_lm_head(lin)]
    assert modules == units(LAYERS)


def test_fuse_projections_concatenates_biases(tmp_path):
    """Qwen2's q/k/v carry biases: one Add of the concatenated bias follows the fused MatMul."""
    from helpers import make_tiny_hf_model

    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.onnx_export import export_onnx

    raw = export_onnx(load_checkpoint(make_tiny_hf_model(tmp_path, "qwen2", num_hidden_layers=LAYERS)),
                      tmp_path / "raw.onnx")
    before, after = ir.load(raw), ir.load(raw)
    assert fuse_projections(after) == 2 * LAYERS
    qkv = [n for n in after.graph if n.op_type == "Split" and n.inputs[0].producer().op_type == "Add"]
    assert len(qkv) == LAYERS
    feeds = feeds_2d(vocab_of(before))
    np.testing.assert_allclose(run(after, feeds), run(before, feeds), atol=1e-5, rtol=0)


def test_optimized_graph_structure(raw_graph):
    """The backend-neutral graph: standard ops and kiln.PagedAttention only."""
    model = ir.load(raw_graph)
    counts = optimize_model(model)
    assert counts == {"flatten_inputs": 2, "fuse_attention": LAYERS, "select_logits": 1,
                      "fuse_projections": 2 * LAYERS}
    ops = op_counts(model)
    assert {n.domain for n in model.graph} == {"", contract.OP_DOMAIN} and ops["PagedAttention"] == LAYERS
    assert ops["Softmax"] == 0
    # per layer one QKV, one o, one gate/up and one down projection; then the LM head
    assert ops["MatMul"] == 4 * LAYERS + 1 and ops["Split"] == 2 * LAYERS
    assert ops["ReduceMean"] == 2 * LAYERS + 1  # the norms, unfused: ONNX Runtime's fusion is its lowering's
    assert ops["Identity"] == 0  # cleanup drops them, so the Reshapes around them collapse
    # RoPE runs inside the op: no rotary subgraph (cos/sin from position_ids, rotate_half) is left
    assert ops["Cos"] == ops["Sin"] == ops["Neg"] == ops["Slice"] == ops["Concat"] == 0, ops
    assert ops["Transpose"] <= 1  # the tied LM head's weight; none around attention
    # no matmul between two activations (Q.K^T, P.V): every MatMul has a constant weight
    for node in model.graph:
        if node.op_type == "MatMul":
            assert any(is_weight(v) for v in node.inputs), f"activation x activation MatMul {node.name} survived"
    attention = [n for n in model.graph if n.op_type == "PagedAttention"]
    assert all(n.domain == contract.OP_DOMAIN for n in attention)
    for layer, node in enumerate(attention):
        assert node.attributes["num_heads"].as_int() == 4
        assert node.attributes["num_kv_heads"].as_int() == 2
        assert node.attributes["scale"].as_float() == pytest.approx(16**-0.5, rel=1e-6)
        assert node.inputs[3].name == contract.kv_cache_input(layer)
        assert node.outputs[1].name == contract.kv_cache_output(layer)
        assert [v.name for v in node.inputs[7:]] == [NO_KV_SCALE, ROTARY_COS, ROTARY_SIN]
        assert node.attributes["rotary_interleaved"].as_int() == 0
    inputs = [v.name for v in model.graph.inputs]
    kv_inputs = [contract.kv_cache_input(i) for i in range(LAYERS)]
    kv_outputs = [contract.kv_cache_output(i) for i in range(LAYERS)]
    assert inputs == [contract.INPUT_IDS, contract.POSITION_IDS, contract.QUERY_START_LOC, contract.SEQ_LENS,
                      contract.BLOCK_TABLES, contract.LOGITS_INDICES] + kv_inputs
    assert [v.name for v in model.graph.outputs] == [contract.LOGITS] + kv_outputs


def test_onnxruntime_lowering_structure(raw_graph):
    """The neutral graph lowered for ONNX Runtime: its norm, residual-norm and SwiGLU fusions and the packed
    attention inputs, each firing once per site; what is left is the ORT engine graph."""
    model = ir.load(raw_graph)
    optimize_model(model)
    counts = lower_for_onnxruntime(model)
    # every norm but the first (it reads the embedding) and the final one (it reads the gathered rows) takes
    # its residual Add along
    assert counts == {"fuse_rmsnorm": 2 * LAYERS + 1, "fuse_skip_rmsnorm": 2 * LAYERS - 1, "fuse_swiglu": LAYERS,
                      "pack_attention_inputs": LAYERS}
    ops = op_counts(model)
    assert ops["SimplifiedLayerNormalization"] == 2 and ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS - 1
    assert ops["SwiGLU"] == LAYERS and ops["Sigmoid"] == ops["Split"] == ops["ReduceMean"] == 0
    assert ops["MatMul"] == 4 * LAYERS + 1
    head = model.graph.outputs[0].producer()
    assert head.inputs[0].producer().op_type == "SimplifiedLayerNormalization"  # on the gathered rows
    assert head.inputs[0].producer().inputs[0].producer().op_type == "Squeeze"
    assert not [name for name in model.graph.initializers if not model.graph.initializers[name].uses()]


@pytest.mark.parametrize("scheme", ["none", "int4-q4_1"])
def test_passes_keep_no_reference_to_the_graph(kiln_raw, scheme):
    """Once the build drops the engine graph nothing may hold it: a rewrite rule's matcher keeps the last graph it
    matched in, and a module-level rule kept a 1B engine's 0.77 GB of quantized weights alive through the build's
    end (its in-process verification then stacked ONNX Runtime's copy on top)."""
    from kiln.optimize.quantize import quantize_model
    from kiln.quant_scheme import QuantScheme

    model = ir.load(kiln_raw)
    optimize_model(model)
    lower_for_onnxruntime(model)
    if scheme != "none":
        quantize_model(model, QuantScheme.parse(scheme))
    graph = weakref.ref(model.graph)
    del model
    gc.collect()
    assert graph() is None, [type(r).__name__ for r in gc.get_referrers(graph())]


@pytest.mark.parametrize("lowered", [False, True], ids=["neutral", "onnxruntime"])
def test_fuse_attention_numerics(raw_graph, tmp_path, lowered):
    """Whole pipeline (the neutral graph, and lowered for ONNX Runtime) vs the raw graph: three sequences
    prefilled in one packed step (one in two chunks), then decode steps with all in flight; every step's logits
    match the full recompute."""
    from engine_driver import PagedDriver

    before, after = ir.load(raw_graph), ir.load(raw_graph)
    optimize_model(after)
    if lowered:
        lower_for_onnxruntime(after)
    ir.save(after, tmp_path / "model.onnx", external_data="model.onnx.data")
    driver = PagedDriver(tmp_path / "model.onnx", num_blocks=32)
    vocab = vocab_of(before)
    rng = np.random.default_rng(1)
    seqs = {s: rng.integers(0, vocab, n).tolist() for s, n in {0: 5, 1: 40, 2: 19}.items()}
    full = {s: run(before, {"input_ids": np.array([t]), "position_ids": np.arange(len(t))[None]})[0]
            for s, t in seqs.items()}

    out = driver.step([(0, seqs[0][:4]), (1, seqs[1][:17]), (2, seqs[2][:19])], all_rows=True)
    np.testing.assert_allclose(out, np.concatenate([full[0][:4], full[1][:17], full[2][:19]]), atol=1e-4, rtol=0)
    out = driver.step([(0, seqs[0][4:5]), (1, seqs[1][17:36])])  # a decode and a prefill chunk together
    np.testing.assert_allclose(out, np.stack([full[0][4], full[1][35]]), atol=1e-4, rtol=0)
    for i in range(36, 40):
        out = driver.step([(1, seqs[1][i:i + 1])])
        np.testing.assert_allclose(out[0], full[1][i], atol=1e-4, rtol=0)


def test_fuse_attention_rotary_in_op_matches_rotary_in_graph(raw_graph, tmp_path):
    """The op's RoPE (cos/sin caches of the graph's own frequencies) against the graph's rotary ops
    feeding a RoPE-less op: the same function up to float32 rounding (1e-5), prefill and decode."""
    drivers = []
    for positions in (0, 64):
        model = ir.load(raw_graph)
        optimize_model(model, AttentionConfig(rotary_positions=positions))
        assert (op_counts(model)["Cos"] == 0) == (positions > 0)
        drivers.append(paged_driver(model, tmp_path, f"model{positions}"))
    assert_same_logits(raw_graph, drivers, seed=2)  # logits up to ~8: float32 rounding


def paged_driver(model: ir.Model, directory, name: str):
    from engine_driver import PagedDriver

    ir.save(model, directory / f"{name}.onnx", external_data=f"{name}.onnx.data")
    return PagedDriver(directory / f"{name}.onnx", num_blocks=16)


def assert_same_logits(raw_graph, drivers, seed: int) -> None:
    """Two sequences, prefill chunks then decodes in flight together: both drivers' logits within 1e-5."""
    tokens = np.random.default_rng(seed).integers(0, vocab_of(ir.load(raw_graph)), 40).tolist()
    steps = [[(0, tokens[:30]), (1, tokens[5:9])], [(0, tokens[30:31]), (1, tokens[9:20])], [(0, tokens[31:32])]]
    for chunks in steps:
        first, second = (driver.step(chunks, all_rows=True) for driver in drivers)
        np.testing.assert_allclose(second, first, atol=1e-5, rtol=1e-5)


def test_pack_attention_inputs(raw_graph, tmp_path):
    """The op reads the fused QKV projection itself: no Split, no Reshape on either side of it, the
    projection's [1, T, (H + 2Hkv)D] in and [1, T, H*D] out; logits unchanged (1e-5), prefill and decode."""
    drivers = []
    for pack in (False, True):
        model = ir.load(raw_graph)
        optimize_model(model)
        before = op_counts(model)
        if pack:
            assert pack_attention_inputs(model) == LAYERS
            after = op_counts(model)
            assert after["Split"] == before["Split"] - LAYERS
            assert after["Reshape"] == before["Reshape"] - 4 * LAYERS, (before, after)
            for node in model.graph:
                if node.op_type != "PagedAttention":
                    continue
                assert [v.name for v in node.inputs[1:3]] == [PACKED_QKV, PACKED_QKV]
                assert node.inputs[0].producer().op_type == "MatMul"  # the fused QKV projection
                assert [u.node.op_type for u in node.outputs[0].uses()] == ["MatMul"]  # the o projection
                # typed with its shape: onnx_ir skips (and logs) a value's shape when its type is unknown
                assert node.outputs[0].type == ir.TensorType(ir.DataType.FLOAT) and node.outputs[0].shape is not None
                assert pack_attention_inputs(model) == 0  # nothing left to pack
        drivers.append(paged_driver(model, tmp_path, f"model{pack}"))
    assert_same_logits(raw_graph, drivers, seed=3)


@pytest.mark.parametrize("family, per_head", [("qwen3", True), ("olmoe", False)])
def test_pack_attention_inputs_folds_qk_norms(tmp_path, family, per_head):
    """Qwen3's per-head and OLMoE's whole-projection q/k RMSNorms become kiln.PagedAttention's q_norm / k_norm (with
    the config's epsilon): the op reads the fused projection with nothing between, and the engine records
    QK_NORM_ABI. (Its logits against transformers: tests/golden.)"""
    import json

    import onnx
    from helpers import make_tiny_hf_model

    from kiln.manifest import BuildOptions, read_manifest
    from kiln.optimize.build import build_engine

    model_dir = make_tiny_hf_model(tmp_path, family=family)
    config = json.loads((model_dir / "config.json").read_text())
    build_engine(model_dir, tmp_path / "engine", BuildOptions(kv_dtype="float32"), progress=lambda _msg: None)
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx"), load_external_data=False).graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    attention = [node for node in graph.node if node.op_type == "PagedAttention"]
    assert len(attention) == config["num_hidden_layers"]
    for node in attention:
        assert producers[node.input[0]].op_type == "MatMul" and list(node.input[1:3]) == [PACKED_QKV] * 2
        widths = [initializers[name].dims[0] for name in node.input[11:13]]
        assert widths == ([head_dim] * 2 if per_head else [heads * head_dim, kv_heads * head_dim])
        epsilon = next(a.f for a in node.attribute if a.name == "qk_norm_epsilon")
        assert epsilon == pytest.approx(config["rms_norm_eps"])
    assert read_manifest(tmp_path / "engine").op_library_abi == contract.QK_NORM_ABI


def test_fuse_attention_fires_zero_times_without_attention(kiln_raw):
    model = ir.load(kiln_raw)
    fuse_attention(model)  # fuse once: nothing is left to match a second time
    assert fuse_attention(model) == 0


def _attention_graph(scale_is_input: bool) -> ir.Model:
    """softmax(Q K^T * s) V on [1, 4, T, 16] graph inputs; s a constant or a graph input."""
    from onnx import TensorProto, helper, numpy_helper

    qkv = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, "T", 16]) for n in ("q", "k", "v")]
    scale = helper.make_tensor_value_info("s", TensorProto.FLOAT, [])
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Mul", ["scores", "s"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["out"]),
    ]
    inits = [] if scale_is_input else [numpy_helper.from_array(np.array(0.25, np.float32), "s")]
    graph = helper.make_graph(nodes, "attn", qkv + ([scale] if scale_is_input else []),
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, "T", 16])], inits)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_fuse_attention_needs_a_constant_scale():
    assert fuse_attention(_attention_graph(scale_is_input=True)) == 0
    model = _attention_graph(scale_is_input=False)
    assert fuse_attention(model) == 1
    node = next(n for n in model.graph if n.op_type == contract.OP_TYPE)
    assert node.attributes["scale"].as_float() == 0.25
    assert node.attributes["num_kv_heads"].as_int() == 4  # no repeat_kv: Hkv == H
