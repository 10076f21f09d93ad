"""AWQ calibration of mixture-of-experts models (calibration/moe_awq.py): the experts' smoothing groups fold
exactly, the searches simulate the build's Q4_1 experts on the rows routed to each expert, and what AWQ cannot do
for them is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_tiny_hf_model

from kiln.calibration import fake_quant
from kiln.calibration.artifact import CalibrationError
from kiln.calibration.calibrate import CalibrationConfig, calibrate
from kiln.calibration.smoothing import ExpertDownGroup, fold, smooth_groups
from kiln.export.checkpoint import load_checkpoint
from kiln.export.reference import ReferenceModel
from kiln.optimize.quant import rtn


def logits(spec, weights, ids):
    with torch.no_grad():
        return ReferenceModel(spec, weights)(ids[None], torch.arange(ids.numel())[None])[0]


def random_ids(n, seed=0):
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed))


def outlier_moe_checkpoint(tmp_path, family):
    """A tiny MoE model whose MLP norm amplifies two channels 40x (the experts' input outliers)."""
    ck = load_checkpoint(make_tiny_hf_model(tmp_path, family))
    weights = dict(ck.weights)
    for i in range(ck.spec.num_layers):
        name = f"model.layers.{i}.post_attention_layernorm.weight"
        weights[name] = weights[name].clone()
        weights[name][[3, 17]] *= 40.0
    return type(ck)(spec=ck.spec, weights=weights, tokenizer=ck.tokenizer, source=ck.source)


def test_q4_1_fake_quant_is_the_builds_q4_1():
    w = torch.randn(3, 24, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 96)
    w[0, 0, :32] = 0.5  # a constant block: step 0
    for e in range(3):
        q = rtn.quantize_q4_1(w[e].numpy())
        ref = (q.q.reshape(24, 3, 32).astype(np.float32) * q.d.astype(np.float32)[..., None]
               + q.m.astype(np.float32)[..., None]).reshape(24, 96)
        np.testing.assert_allclose(fake_quant.q4_1(w)[e].numpy(), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "mixtral"])
def test_folding_expert_scales_is_exact(tmp_path, family):
    """Random scales on every group (the experts' shared input scale through the norm into the router, every
    expert's gate/up and the shared expert; each expert's own down scales through its up rows) leave the logits."""
    ck = load_checkpoint(make_tiny_hf_model(tmp_path, family))
    groups = smooth_groups(ck.spec, gqa_o=True)
    gen = torch.Generator().manual_seed(1)
    scales = {}
    for g in groups:
        if isinstance(g, ExpertDownGroup):
            e, _, f = ck.weights[g.down].shape
            scales[g.name] = torch.exp(torch.randn(e, f, generator=gen))
        else:
            scales[g.name] = g.tie(torch.exp(torch.randn(ck.weights[f"{g.linears[0]}.weight"].shape[1],
                                                         generator=gen)))
    folded = fold(ck.weights, groups, scales)
    assert folded.keys() == ck.weights.keys()
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "model.layers.0.mlp.experts.down_proj", "model.layers.0.post_attention_layernorm.weight"):
        assert not torch.equal(folded[name], ck.weights[name]), name
    ids = random_ids(40)
    torch.testing.assert_close(logits(ck.spec, folded, ids), logits(ck.spec, ck.weights, ids), rtol=1e-4, atol=1e-4)
    # expert e's own scales: its up rows divided, its down columns multiplied, its gate rows untouched
    down = next(g for g in groups if isinstance(g, ExpertDownGroup))
    s, f = scales[down.name], ck.spec.intermediate_size
    inputs = scales[down.name.replace("experts.down", "gate_up")]
    gate_up = ck.weights[down.gate_up] * inputs
    torch.testing.assert_close(folded[down.gate_up][:, :f], gate_up[:, :f])
    torch.testing.assert_close(folded[down.gate_up][:, f:], gate_up[:, f:] / s[:, :, None])
    torch.testing.assert_close(folded[down.down], ck.weights[down.down] * s[:, None, :])


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_awq_expert_scales_beat_plain_q4_1_on_routed_rows(tmp_path, family):
    ck = outlier_moe_checkpoint(tmp_path, family)
    messages = []
    artifact = calibrate(ck, random_ids(512).tolist(),
                         CalibrationConfig("awq", num_windows=4, window=128, rows_per_window=64, group_size=32),
                         messages.append)
    assert any("without norm tuning" in m for m in messages)
    assert artifact.hyperparameters["norm_tuning"] is None and artifact.hyperparameters["int8_fallback"] == 0
    report = artifact.info["groups"]
    spec = ck.spec
    for i in range(spec.num_layers):
        inputs, down = report[f"model.layers.{i}.mlp.gate_up"], report[f"model.layers.{i}.mlp.experts.down"]
        assert inputs["ratio"] > 0 and inputs["error"] < inputs["error_rtn"]  # the outliers call for real scales
        assert down["error"] <= down["error_rtn"] and len(down["ratios"]) == spec.num_experts
        assert artifact.scales[f"model.layers.{i}.mlp.gate_up"].shape == (spec.hidden_size,)
        assert artifact.scales[f"model.layers.{i}.mlp.experts.down"].shape == (spec.num_experts,
                                                                               spec.intermediate_size)
        if spec.shared_expert_intermediate_size:
            shared = report[f"model.layers.{i}.mlp.shared_expert.down"]
            assert shared["error"] <= shared["error_rtn"]
    assert "kv.k_absmax" in artifact.scales


def test_moe_calibration_refuses_what_awq_cannot_do_for_experts(tmp_path):
    ck = load_checkpoint(make_tiny_hf_model(tmp_path, "mixtral"))
    ids = random_ids(256).tolist()
    with pytest.raises(CalibrationError, match="smoothquant calibration does not support mixture-of-experts"):
        calibrate(ck, ids, CalibrationConfig("smoothquant", num_windows=2, window=64))
    with pytest.raises(CalibrationError, match="drop --int8-fallback"):
        calibrate(ck, ids, CalibrationConfig("awq", num_windows=2, window=64, int8_fallback=2))
