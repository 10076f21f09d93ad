"""AWQ's int8 fallback: the sensitivity scores (calibration/sensitivity.py), the artifact's int8_linears,
the norm tuning's simulation of them, and the int4 pass keeping exactly those linears int8."""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch
from test_quant_passes import tiny_graph

from kiln.calibration import fake_quant, norm_tuning, sensitivity
from kiln.calibration.artifact import CalibrationArtifact, CalibrationError
from kiln.calibration.calibrate import CalibrationConfig, calibrate
from kiln.export.checkpoint import load_checkpoint
from kiln.export.reference import ReferenceModel
from kiln.optimize.quant.graph import MODULES_KEY, find_linears, linear_modules
from kiln.optimize.quantize_int4 import quantize_int4


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir):
    return load_checkpoint(tiny_model_dir)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed))


def _loss(spec, weights, ids) -> float:
    with torch.no_grad():
        logits = ReferenceModel(spec, weights)(ids[None], torch.arange(ids.numel())[None])[0]
    return float(torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum"))


def test_first_order_terms_sum_to_the_directional_derivative(checkpoint):
    spec, weights = checkpoint.spec, {k: v.float() for k, v in checkpoint.weights.items()}
    units = sensitivity.units(spec.num_layers)
    assert len(units) == 4 * spec.num_layers and units[0] == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    delta = {n: fake_quant.int4_groupwise(weights[f"{n}.weight"], 32) - weights[f"{n}.weight"]
             for u in units for n in u}
    ids = _ids(48)
    terms = sensitivity.first_order_terms(ReferenceModel(spec, weights), delta, units, ids)
    eps = 1e-2
    for unit in (units[0], units[3], units[-2]):  # fused q/k/v, down, fused gate/up of the last layer
        moved = [{**weights, **{f"{n}.weight": weights[f"{n}.weight"] + sign * eps * delta[n] for n in unit}}
                 for sign in (1, -1)]
        numeric = (_loss(spec, moved[0], ids) - _loss(spec, moved[1], ids)) / (2 * eps)
        assert terms[unit].shape == (ids.numel() - 1,)
        assert float(terms[unit].sum()) == pytest.approx(numeric, rel=2e-2, abs=1e-4)


def test_int8_fallback_is_chosen_recorded_and_simulated(checkpoint, tmp_path):
    config = CalibrationConfig("awq", num_windows=2, window=64, rows_per_window=16, group_size=32, int8_fallback=2)
    artifact = calibrate(checkpoint, _ids(200).tolist(), config)
    scores = artifact.info["int8_fallback_scores"]
    assert len(scores) == 4 * checkpoint.spec.num_layers and all(s >= 0 for s in scores.values())
    chosen = list(artifact.info["int8_fallback"])
    assert chosen == sorted(scores, key=lambda u: -scores[u])[:2]
    names = artifact.hyperparameters["int8_linears"]
    assert names == [m for unit in chosen for m in unit.split("+")]
    assert artifact.hyperparameters["int8_fallback"] == 2 and "norm_tuning" in artifact.info
    loaded = CalibrationArtifact.load(artifact.save(tmp_path / "awq"))
    assert loaded.hyperparameters["int8_linears"] == names
    # the norm tuning sees those linears int8 per channel, the others int4
    w = {k: v.float() for k, v in checkpoint.weights.items()}
    simulated = norm_tuning.int4_simulated(w, 32, frozenset(names))
    for key in (k for k in w if ".layers." in k and k.endswith("_proj.weight")):
        quant = fake_quant.int8_per_channel if key[: -len(".weight")] in names else (
            lambda t: fake_quant.int4_groupwise(t, 32))
        torch.testing.assert_close(simulated[key], quant(w[key]), rtol=0, atol=0)


def test_bad_int8_fallback_options():
    with pytest.raises(CalibrationError, match="number of decoder units"):
        CalibrationConfig("awq", int8_fallback=-1)
    with pytest.raises(CalibrationError, match="goes with --method awq"):
        CalibrationConfig("smoothquant", int8_fallback=2)


def _named(model: ir.Model) -> ir.Model:
    for lin in find_linears(model):  # what the exporter's metadata says for a torch module
        lin.matmul.metadata_props["namespace"] = (f": Model/model.mlp: MLP/model.mlp.{lin.matmul.name}: "
                                                  f"torch.nn.modules.linear.Linear/linear_1: aten.linear.default")
    return model


def test_int4_pass_keeps_the_named_linears_int8():
    model, _ = tiny_graph()
    model = _named(model)
    assert [linear_modules(lin.matmul) for lin in find_linears(model)][:2] == [("model.mlp.up",), ("model.mlp.down",)]
    quantize_int4(model, 32, int8_modules=frozenset({"model.mlp.down"}))
    bits = {n.inputs[1].name.split(".")[0]: n.attributes["bits"].as_int()
            for n in model.graph if n.op_type == "MatMulNBits"}
    assert bits == {"up_t": 4, "down_t": 8, "embed": 8}  # the LM head int8 as always
    fused = ir.node("MatMul", [], metadata_props={MODULES_KEY: "a.q_proj,a.k_proj"})
    assert linear_modules(fused) == ("a.q_proj", "a.k_proj")
    with pytest.raises(ValueError, match="does not have"):
        quantize_int4(_named(tiny_graph()[0]), 32, int8_modules=frozenset({"model.mlp.gate"}))
