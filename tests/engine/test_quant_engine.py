"""Quantized engines: each scheme's pass on the tiny engine graph runs with the kiln op library
and stays close to the fp32 engine; a calibrated build folds its artifact; a foreign one is refused."""

from __future__ import annotations

import shutil

import numpy as np
import onnx_ir as ir
import pytest
import torch
from engine_driver import PagedDriver

from kiln.manifest import BuildOptions, read_manifest
from kiln.optimize.quantize import quantize_model
from kiln.quant_scheme import LmHead, QuantScheme

W8A8 = QuantScheme.parse("w8a8-smoothquant")
PROMPT = [5, 77, 190, 33, 250, 12, 8, 99, 140, 201, 64, 3, 17, 222, 180, 45, 71, 300, 9, 128] * 2


def engine_logits(model_path) -> np.ndarray:
    driver = PagedDriver(model_path, threads=1, num_blocks=16)
    first = driver.step([(0, PROMPT[:25])], all_rows=True)  # a prefill chunk, then the rest
    rest = driver.step([(0, PROMPT[25:])], all_rows=True)
    return np.concatenate([first, rest])


def quantized_copy(engine, tmp_path, scheme: str, lm_head: LmHead = LmHead.INT8):
    model = ir.load(engine / "model.onnx")
    count = quantize_model(model, QuantScheme.parse(scheme), lm_head)
    out = tmp_path / f"{scheme}-{lm_head.value}"
    out.mkdir()
    ir.save(model, out / "model.onnx", external_data="model.onnx.data")
    return out / "model.onnx", count


# Tied tiny models of each family (Phi3ForCausalLM as Phi-4-mini: LongRoPE, partial rotary; Gemma 2 with its
# soft-capped attention and logits, Gemma 3 with 5 local : 1 global layers): the thresholds below were set on the
# tied llama; a random untied head gives flatter logits whose argmax flips at their edge.
@pytest.fixture(scope="module", params=["llama", "qwen3", "phi4", "gemma2", "gemma3"])
def family_engine(request, tmp_path_factory):
    """The tiny engine of each family: llama's is the session's tiny_engine, the others are built here."""
    if request.param == "llama":
        return request.getfixturevalue("tiny_engine")
    from helpers import make_tiny_hf_model

    from kiln.optimize.build import build_engine

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_engine(make_tiny_hf_model(folder, request.param), folder / "engine", progress=lambda _msg: None)
    return folder / "engine"


@pytest.mark.parametrize("scheme,tolerance,agreement", [
    ("int8-weight-only", 0.05, 0.95),
    ("int4-rtn-g32", 0.3, 0.75),
    ("int4-rtn-g128", 0.35, 0.65),
    ("int4-q4_1", 0.3, 0.75),
    ("w8a8-smoothquant", 0.05, 0.95),  # the W8A8 pass alone (no scales: the graph is the fp32 one)
])
def test_quantized_engine_graph_runs_and_stays_close(family_engine, tmp_path, scheme, tolerance, agreement):
    fp32 = engine_logits(family_engine / "model.onnx")
    path, count = quantized_copy(family_engine, tmp_path, scheme)
    layers = read_manifest(family_engine).spec.num_layers
    assert count == layers * 4 + 1  # fused qkv, o, fused gate/up, down per layer + the LM head
    out = engine_logits(path)
    rel = np.abs(out - fp32).max() / np.abs(fp32).max()
    assert rel < tolerance, rel
    assert (out.argmax(-1) == fp32.argmax(-1)).mean() >= agreement


def decode_logits(model_path) -> np.ndarray:
    """One logits row per step: the prompt's first 20 tokens prefilled, then 10 decoded one at a time."""
    driver = PagedDriver(model_path, threads=1, num_blocks=16)
    rows = [driver.step([(0, PROMPT[:20])])]
    rows += [driver.step([(0, [token])]) for token in PROMPT[20:30]]
    return np.concatenate(rows)


def test_int4_rescored_head_on_the_engine_graph(tiny_engine, tmp_path):
    """On the engine's [1, T, V] logits, one row a step and prefill chunks of 25 and 15 rows alike (an int4-q4_1
    head is rescored at every row count): the int4 head's logits outside its top k, and inside them the 8-bit
    head's up to its rounding (the int8 head's per-channel scales against the table's blocks of 32), far closer
    than the int4 head's."""
    from kiln.optimize.rescore_lm_head import RESCORE_TOP_K

    heads = (LmHead.INT8, LmHead.INT4, LmHead.INT4_RESCORED)
    engines = {head: quantized_copy(tiny_engine, tmp_path, "int4-q4_1", head)[0] for head in heads}
    for logits in (decode_logits, engine_logits):
        int8, int4, rescored = (logits(engines[head]) for head in heads)
        top = np.argsort(-int4, axis=-1)[:, :RESCORE_TOP_K]
        outside = np.ones_like(int4, dtype=bool)
        np.put_along_axis(outside, top, False, axis=-1)
        np.testing.assert_array_equal(rescored[outside], int4[outside])
        inside = ~outside
        assert np.abs(rescored - int8)[inside].max() < 0.2 * np.abs(int4 - int8)[inside].max()
        assert (rescored.argmax(-1) == int8.argmax(-1)).mean() >= 0.95


def test_calibrated_build_folds_scales_and_refuses_foreign_artifacts(tiny_model_dir, tiny_engine, tmp_path):
    from helpers import make_tiny_hf_model

    from kiln.calibration.calibrate import CalibrationConfig, calibrate
    from kiln.export.checkpoint import load_checkpoint
    from kiln.optimize.build import BuildError, build_engine

    ck = load_checkpoint(tiny_model_dir)
    ids = torch.randint(3, 320, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    art = calibrate(ck, ids, CalibrationConfig("smoothquant", num_windows=4, window=128, rows_per_window=32))
    art_dir = art.save(tmp_path / "sq")

    other = make_tiny_hf_model(tmp_path / "other", "llama", seed=7)
    with pytest.raises(BuildError, match="made for another model"):
        build_engine(other, tmp_path / "bad", BuildOptions(quantization=W8A8, calibration=art_dir),
                     progress=lambda _m: None)
    with pytest.raises(BuildError, match="needs awq scales, but .* holds smoothquant scales"):
        build_engine(tiny_model_dir, tmp_path / "bad",
                     BuildOptions(quantization=QuantScheme.parse("int4-awq-g128"), calibration=art_dir),
                     progress=lambda _m: None)
    with pytest.raises(BuildError, match="needs the scales of `kiln calibrate MODEL --method smoothquant"):
        build_engine(tiny_model_dir, tmp_path / "bad", BuildOptions(quantization=W8A8), progress=lambda _m: None)

    engine = tmp_path / "w8a8"
    build_engine(tiny_model_dir, engine, BuildOptions(quantization=W8A8, calibration=art_dir),
                 progress=lambda _m: None)
    manifest = read_manifest(engine)
    assert manifest.build.quantization.name == "w8a8-smoothquant" and manifest.build.calibration == art_dir
    fp32 = engine_logits(tiny_engine / "model.onnx")
    out = engine_logits(engine / "model.onnx")
    assert np.abs(out - fp32).max() / np.abs(fp32).max() < 0.08
    assert (out.argmax(-1) == fp32.argmax(-1)).mean() >= 0.9
    shutil.rmtree(engine)


def nbits_weight(node) -> np.ndarray:
    """The dequantized [N, K] weights of a 4-bit MatMulNBits node (its initializers, MatMulNBits layout)."""
    n, k, group = (node.attributes[a].as_int() for a in ("N", "K", "block_size"))
    packed = node.inputs[1].const_value.numpy().reshape(n, -1, group // 2)
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(n, -1, group).astype(np.float32)
    scales = node.inputs[2].const_value.numpy().reshape(n, -1)
    zp = node.inputs[3].const_value.numpy().reshape(n, -1)
    zp = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, : scales.shape[1]].astype(np.float32)
    return ((codes - zp[..., None]) * scales[..., None]).reshape(n, -1)[:, :k]


def test_awq_build_applies_scales_and_clips(tiny_model_dir, tiny_engine, tmp_path):
    from kiln.calibration import awq
    from kiln.calibration.artifact import apply_artifact
    from kiln.calibration.calibrate import CalibrationConfig, calibrate
    from kiln.export.checkpoint import load_checkpoint
    from kiln.optimize.build import build_engine

    ck = load_checkpoint(tiny_model_dir)
    ids = torch.randint(3, 320, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    config = CalibrationConfig("awq", num_windows=4, window=128, rows_per_window=32, group_size=32, int8_fallback=1)
    art = calibrate(ck, ids, config)
    assert any(k.startswith(awq.CLIP_PREFIX) for k in art.scales)
    int8 = art.hyperparameters["int8_linears"]  # one unit: q/k/v (fused), o, gate/up (fused) or down
    art_dir = art.save(tmp_path / "awq")
    engine = tmp_path / "awq-g32"
    build_engine(tiny_model_dir, engine,
                 BuildOptions(quantization=QuantScheme.parse("int4-awq-g32"), calibration=art_dir),
                 progress=lambda _m: None)
    # the build's conversion step (apply_artifact) really clips o_proj, and the engine stays close to fp32
    clipped = apply_artifact(ck, art).weights["model.layers.0.self_attn.o_proj.weight"].numpy()
    assert not np.array_equal(clipped, ck.weights["model.layers.0.self_attn.o_proj.weight"].numpy())
    fp32 = engine_logits(tiny_engine / "model.onnx")
    out = engine_logits(engine / "model.onnx")
    assert np.abs(out - fp32).max() / np.abs(fp32).max() < 0.3
    assert (out.argmax(-1) == fp32.argmax(-1)).mean() >= 0.75
    assert read_manifest(engine).build.quantization.name == "int4-awq-g32"
    # the int8 fallback's unit is one 8-bit MatMulNBits, next to the int8 LM head; the rest int4
    bits = sorted(n.attributes["bits"].as_int() for n in ir.load(engine / "model.onnx").graph
                  if n.op_type == "MatMulNBits")
    assert 1 <= len(int8) <= 3 and bits.count(8) == 2 and bits.count(4) == len(bits) - 2
    # GPTQ's rounding (the default) reaches the engine code for code: an o_proj's MatMulNBits dequantizes to the
    # artifact's GPTQ weights (o_proj is never fused, so its weights are one node's)
    o_proj = next(f"model.layers.{i}.self_attn.o_proj" for i in range(ck.spec.num_layers)
                  if f"model.layers.{i}.self_attn.o_proj" not in int8)
    rounded = apply_artifact(ck, art).weights[f"{o_proj}.weight"].numpy()
    engine_weights = [nbits_weight(n) for n in ir.load(engine / "model.onnx").graph
                      if n.op_type == "MatMulNBits" and n.attributes["bits"].as_int() == 4]
    assert any(w.shape == rounded.shape and np.allclose(w, rounded, rtol=1e-6, atol=1e-8) for w in engine_weights)


def test_q4_1_engine_reproduces_q4_1_weights(tiny_engine, tmp_path):
    """On weights already on a Q4_1 grid (a Q4_1 GGUF) the int4-q4_1 engine matches fp32 up to its
    int8 activations, where int4-rtn-g32 rounds them a second time."""
    from kiln.optimize.quant.graph import find_linears, is_lm_head
    from kiln.optimize.quant.rtn import quantize_q4_1

    model = ir.load(tiny_engine / "model.onnx")
    snapped = 0
    for lin in find_linears(model):
        if is_lm_head(lin):
            continue
        value = lin.matmul.inputs[1]
        assert value.const_value is not None  # [K, N] initializer
        value.const_value = ir.tensor(np.ascontiguousarray(quantize_q4_1(lin.weight).dequantize().T), name=value.name)
        snapped += 1
    assert snapped == 2 * 4  # fused qkv, o, fused gate/up, down
    q4 = tmp_path / "q4_1-source"
    shutil.copytree(tiny_engine, q4)
    ir.save(model, q4 / "model.onnx", external_data="model.onnx.data")
    fp32 = engine_logits(q4 / "model.onnx")
    errors = {}
    for scheme in ("int4-q4_1", "int4-rtn-g32"):
        path, _ = quantized_copy(q4, tmp_path, scheme)
        out = engine_logits(path)
        errors[scheme] = np.abs(out - fp32).max() / np.abs(fp32).max()
    assert errors["int4-q4_1"] < 0.05, errors
    assert errors["int4-q4_1"] < 0.5 * errors["int4-rtn-g32"], errors
