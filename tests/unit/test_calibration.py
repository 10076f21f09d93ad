"""Calibration: exact scale folding, SmoothQuant / AWQ searches, the artifact and its fingerprint check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import make_tiny_hf_model

from kiln.calibration import fake_quant
from kiln.calibration.artifact import CalibrationArtifact, CalibrationError, apply_artifact
from kiln.calibration.calibrate import CalibrationConfig, calibrate
from kiln.calibration.smoothing import fold, smooth_groups
from kiln.export.checkpoint import load_checkpoint
from kiln.export.reference import ReferenceModel
from kiln.optimize.quant import rtn


def logits(checkpoint, ids):
    model = ReferenceModel(checkpoint.spec, checkpoint.weights)
    with torch.no_grad():
        return model(ids[None], torch.arange(ids.numel())[None])[0]


def random_ids(n, vocab=320, seed=0):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,overrides", [
    ("llama", {}),                                   # GQA: no o_proj group
    ("llama", {"num_key_value_heads": 4}),           # MHA: o_proj smoothed through v_proj
    ("qwen2", {"num_key_value_heads": 4}),           # q/k/v biases
    ("qwen3", {}),                                   # q/k norms after the smoothed projections
    ("phi3", {}),                                    # fused checkpoint weights, MHA, LongRoPE
    ("gemma2", {}),                                  # the MLP reads pre_feedforward_layernorm (sandwich norms)
    ("gemma3", {}),                                  # and q/k norms, MQA
])
def test_folding_any_scales_is_exact(tmp_path, family, overrides):
    ck = load_checkpoint(make_tiny_hf_model(tmp_path, family, **overrides))
    has_o_group = any(g.name.endswith("self_attn.o") for g in smooth_groups(ck.spec))
    assert has_o_group == (ck.spec.num_heads == ck.spec.num_kv_heads)
    groups = smooth_groups(ck.spec, gqa_o=True)  # AWQ's: o_proj through v_proj under GQA too, scales tied
    assert any(g.name.endswith("self_attn.o") for g in groups)
    gen = torch.Generator().manual_seed(1)
    scales = {}
    for g in groups:
        k = ck.weights[f"{g.linears[0]}.weight"].shape[1]
        scales[g.name] = g.tie(torch.exp(torch.randn(k, generator=gen)))  # factors ~ e^±2
    folded = fold(ck.weights, groups, scales)
    assert folded.keys() == ck.weights.keys()
    ids = random_ids(40)
    ref = logits(ck, ids)
    out = logits(type(ck)(spec=ck.spec, weights=folded, tokenizer=None, source="folded"), ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # the weights really changed, and the embedding / LM head did not
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(folded[q_proj], ck.weights[q_proj])
    assert torch.equal(folded["model.embed_tokens.weight"], ck.weights["model.embed_tokens.weight"])
    o = next(g for g in groups if g.name.endswith("self_attn.o"))
    if o.heads_per_kv > 1:  # untied o scales cannot be folded through v_proj
        with pytest.raises(ValueError, match="not tied"):
            fold(ck.weights, [o], {o.name: torch.exp(torch.randn(ck.spec.num_heads * ck.spec.head_dim, generator=gen))})


def test_fake_quant_matches_the_numpy_reference():
    w = torch.randn(48, 200, generator=torch.Generator().manual_seed(0))
    for group in (32, 64, 128):
        ref = rtn.quantize_groupwise(w.numpy(), 4, group).dequantize()
        np.testing.assert_allclose(fake_quant.int4_groupwise(w, group).numpy(), ref, rtol=0, atol=1e-5)
    q, s = rtn.quantize_per_channel_int8(w.numpy())
    np.testing.assert_allclose(fake_quant.int8_per_channel(w).numpy(), q * s[:, None], rtol=0, atol=1e-6)


@pytest.fixture
def outlier_checkpoint(tmp_path):
    """A tiny model whose first RMSNorm amplifies two channels 40x (LLM-style activation outliers)."""
    ck = load_checkpoint(make_tiny_hf_model(tmp_path, "llama"))
    weights = dict(ck.weights)
    for i in range(ck.spec.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = weights[f"model.layers.{i}.{norm}.weight"].clone()
            w[[3, 17]] *= 40.0
            weights[f"model.layers.{i}.{norm}.weight"] = w
    return type(ck)(spec=ck.spec, weights=weights, tokenizer=ck.tokenizer, source=ck.source)


def test_smoothquant_artifact_roundtrip_and_exact_apply(outlier_checkpoint, tmp_path, recorded_bars):
    ck = outlier_checkpoint
    config = CalibrationConfig("smoothquant", num_windows=4, window=64, rows_per_window=32)
    messages = []
    artifact = calibrate(ck, random_ids(400).tolist(), config, messages.append, corpus="random ids")
    assert messages and "window 4/4" in " ".join(messages)
    groups = len(artifact.info["groups"])
    assert recorded_bars == [("calibration windows", 4, 4), ("smoothquant scales", groups, groups)]
    report = artifact.info["groups"]
    qkv = report["model.layers.0.self_attn.qkv"]
    assert qkv["alpha"] is not None and qkv["error"] < 0.5 * qkv["error_unsmoothed"]
    assert artifact.scales["kv.k_absmax"].shape == (ck.spec.num_layers, ck.spec.num_kv_heads)
    path = artifact.save(tmp_path / "sq")
    loaded = CalibrationArtifact.load(path)
    assert loaded.method == "smoothquant" and loaded.model_fingerprint == ck.fingerprint()
    assert loaded.info["groups"] == report
    for k, v in artifact.scales.items():
        torch.testing.assert_close(loaded.scales[k], v)
    smoothed = apply_artifact(ck, loaded)
    ids = random_ids(50, seed=3)
    torch.testing.assert_close(logits(smoothed, ids), logits(ck, ids), rtol=1e-4, atol=1e-4)
    # the outliers moved into the weights: the smoothed norm weight is much flatter
    norm = smoothed.weights["model.layers.0.input_layernorm.weight"].abs()
    assert norm.max() / norm.median() < 10


# plain; K after k_norm; partial rotary + factor; layer 0 of Gemma 3 rotates at the local base
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi4", "gemma3"])
def test_kv_bounds_hold_after_rope(tmp_path, family):
    """The calibrated K bound covers the K the cache holds (post k_norm, post RoPE, LongRoPE's attention factor
    on the rotated dims) and is not far above it."""
    from kiln.export.reference import apply_rope

    ck = load_checkpoint(make_tiny_hf_model(tmp_path, family))
    if ck.spec.qk_norm:  # k_norm undoes any scale of k_proj: a bound taken before it would be 10x off
        weights = {name: w * 10 if name.endswith("k_proj.weight") else w for name, w in ck.weights.items()}
        ck = dataclasses.replace(ck, weights=weights)
    artifact = calibrate(ck, random_ids(256).tolist(), CalibrationConfig("smoothquant", 2, 128, 8, alpha=0.5))
    model = ReferenceModel(ck.spec, ck.weights)
    attn = model.model.layers[0].self_attn
    seen = []
    hook = (attn.k_norm if ck.spec.qk_norm else attn.k_proj).register_forward_hook(lambda m, a, o: seen.append(o))
    ids = random_ids(256)[:128]
    with torch.no_grad():
        model(ids[None], torch.arange(128)[None])
    hook.remove()
    k = seen[0].reshape(1, 128, ck.spec.num_kv_heads, ck.spec.head_dim).transpose(1, 2)
    cos, sin = model.rope_cos_sin(torch.arange(128)[None], local=ck.spec.uses_local_rope(0))
    cached = apply_rope(k, cos, sin)[0].abs().amax((1, 2))  # [Hkv]
    bound = artifact.scales["kv.k_absmax"][0]
    assert torch.all(cached <= bound * (1 + 1e-5))
    assert torch.all(bound < 2 * cached)


def test_awq_never_worse_than_rtn_on_calibration_rows(outlier_checkpoint):
    artifact = calibrate(outlier_checkpoint, random_ids(400).tolist(),
                         CalibrationConfig("awq", num_windows=4, window=64, rows_per_window=32, group_size=32))
    assert artifact.hyperparameters["group_size"] == 32
    report = artifact.info["groups"]
    assert all(r["error"] <= r["error_rtn"] for r in report.values())
    assert report["model.layers.0.self_attn.qkv"]["ratio"] > 0  # outliers make AWQ pick real scales
    assert report["model.layers.0.self_attn.qkv"]["error"] < report["model.layers.0.self_attn.qkv"]["error_rtn"]


def test_artifact_for_another_model_is_refused(tmp_path, outlier_checkpoint):
    artifact = calibrate(outlier_checkpoint, random_ids(200).tolist(), CalibrationConfig("awq", 2, 64, 8))
    other = load_checkpoint(make_tiny_hf_model(tmp_path / "other", "llama", seed=5))
    with pytest.raises(CalibrationError, match="made for another model"):
        apply_artifact(other, artifact)


def test_bad_config_and_missing_artifact(tmp_path):
    with pytest.raises(CalibrationError, match="unknown calibration method"):
        CalibrationConfig("gptq")
    with pytest.raises(CalibrationError, match="alpha"):
        CalibrationConfig("smoothquant", alpha=1.5)
    with pytest.raises(CalibrationError, match="not a calibration artifact"):
        CalibrationArtifact.load(tmp_path)


def test_awq_clip_search_lowers_a_tiny_layers_int4_error():
    from kiln.calibration import awq

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 96, generator=gen)
    w = 0.05 * torch.randn(24, 96, generator=gen)
    w[torch.rand(w.shape, generator=gen) < 0.03] *= 6  # a few large weights stretch their groups' range
    ratio, report = awq.clip_search(x[:256], w, 32)
    assert ratio.shape == (24, 3)
    assert ratio.min() >= min(awq.CLIP_GRID) and ratio.max() <= 1.0 and (ratio < 1).any()
    assert report["error"] < report["error_noclip"]

    def error(rows, clip):
        q = fake_quant.int4_groupwise(awq.apply_clip(w, clip, 32), 32)
        return float(((rows @ (q - w).T) ** 2).sum())

    assert error(x[:256], ratio) == pytest.approx(report["error"], rel=1e-5)
    assert error(x[256:], ratio) < error(x[256:], torch.ones_like(ratio))  # held-out rows too
    # the clip is a per-(row, group) clamp at ratio * the group's max |w|
    clipped = awq.apply_clip(w, ratio, 32).reshape(24, 3, 32)
    bound = w.reshape(24, 3, 32).abs().amax(-1) * ratio
    assert torch.all(clipped.abs().amax(-1) <= bound * (1 + 1e-6))
    # a K that is not a multiple of the group (the int4 pass pads the last group with zeros)
    ratio_pad, rep_pad = awq.clip_search(x[:256, :80], w[:, :80], 32)
    assert ratio_pad.shape == (24, 3) and rep_pad["error"] <= rep_pad["error_noclip"]
    assert awq.apply_clip(w[:, :80], ratio_pad, 32).shape == (24, 80)


def test_awq_clips_are_recorded_round_trip_and_applied_at_build(outlier_checkpoint, tmp_path):
    from kiln.calibration import awq

    ck = outlier_checkpoint  # rounded to nearest: GPTQ would put its own weights in place of the clipped ones
    config = CalibrationConfig("awq", num_windows=4, window=64, rows_per_window=32, group_size=32, rounding="rtn")
    artifact = calibrate(ck, random_ids(400).tolist(), config)
    clips = {k: v for k, v in artifact.scales.items() if k.startswith(awq.CLIP_PREFIX)}
    assert clips and artifact.hyperparameters["clip_grid"] == list(awq.CLIP_GRID)
    assert all(k.endswith(awq.CLIP_LINEARS) for k in clips)  # v/o only (q/k as in AWQ; MLP measured worse)
    assert f"{awq.CLIP_PREFIX}model.layers.0.self_attn.o_proj" in clips
    for rep in artifact.info["clips"].values():
        assert rep["error"] <= rep["error_noclip"]
    loaded = CalibrationArtifact.load(artifact.save(tmp_path / "awq"))
    assert loaded.info["clips"] == artifact.info["clips"]
    for k, v in clips.items():
        torch.testing.assert_close(loaded.scales[k], v, rtol=0, atol=0)
    applied = apply_artifact(ck, loaded)
    folded = fold(ck.weights, smooth_groups(ck.spec, gqa_o=True), loaded.scales)
    for key, ratio in clips.items():
        name = f"{key[len(awq.CLIP_PREFIX):]}.weight"
        torch.testing.assert_close(applied.weights[name], awq.apply_clip(folded[name], ratio, 32))
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(applied.weights[q], folded[q])
    # without the clip search the artifact holds no clips and the fold stays exact
    plain = calibrate(ck, random_ids(400).tolist(), CalibrationConfig("awq", 4, 64, 32, group_size=32, clip=False,
                                                                      rounding="rtn"))
    assert not any(k.startswith(awq.CLIP_PREFIX) for k in plain.scales) and "clips" not in plain.info


def test_awq_norm_tuning_pulls_the_int4_model_towards_fp32(outlier_checkpoint, tmp_path, recorded_bars):
    from kiln.calibration import gptq, norm_tuning

    ck = outlier_checkpoint
    messages = []
    config = CalibrationConfig("awq", num_windows=4, window=64, rows_per_window=32, group_size=32)
    ids = random_ids(400)
    artifact = calibrate(ck, ids.tolist(), config, messages.append)
    groups, linears = len(artifact.info["groups"]), 7 * ck.spec.num_layers  # clip_all looks at every linear
    # the default fallback: one unit in four int8, and GPTQ for the other linears of gptq.LINEARS
    int8 = frozenset(artifact.hyperparameters["int8_linears"])
    assert artifact.hyperparameters["int8_fallback"] == len(artifact.info["int8_fallback"]) == ck.spec.num_layers
    linears_all = {n[: -len(".weight")] for n in ck.weights if ".layers." in n and n.endswith("_proj.weight")}
    rounded = len([m for m in linears_all if m.endswith(gptq.LINEARS) and m not in int8])
    epochs = [(f"norm tuning epoch {e + 1}/{norm_tuning.EPOCHS}", 4, 4) for e in range(norm_tuning.EPOCHS)]
    assert recorded_bars == [("calibration windows", 4, 4), ("awq scales", groups, groups),
                             ("awq clips", linears, linears), ("int8 fallback scores", 4, 4),
                             ("gptq rounding", rounded, rounded), *epochs]
    report = artifact.info["norm_tuning"]
    assert report["kl_after"] < 0.97 * report["kl_before"]
    assert any("norm tuning" in m for m in messages)
    assert artifact.hyperparameters["norm_tuning"] == {"epochs": norm_tuning.EPOCHS,
                                                       "learning_rate": norm_tuning.LEARNING_RATE}
    gains = {k: v for k, v in artifact.scales.items() if k.startswith(norm_tuning.GAIN_PREFIX)}
    assert len(gains) == 2 * ck.spec.num_layers + 1
    assert all(not torch.equal(g, torch.ones_like(g)) for g in gains.values())

    # the report's KL is that of the int4-simulated model with the gains folded in
    loaded = CalibrationArtifact.load(artifact.save(tmp_path / "awq"))
    untuned = CalibrationArtifact(loaded.method, loaded.model_fingerprint, loaded.hyperparameters,
                                  {k: v for k, v in loaded.scales.items() if k not in gains})
    plain, tuned = apply_artifact(ck, untuned).weights, apply_artifact(ck, loaded).weights
    for key, gain in gains.items():
        name = f"{key[len(norm_tuning.GAIN_PREFIX):]}.weight"
        torch.testing.assert_close(tuned[name], plain[name] * gain)
    q = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(tuned[q], plain[q])  # the linears are what the int4 pass quantizes

    from kiln.calibration.collect import token_windows

    windows = token_windows(ids.tolist(), 64, 4)

    def kl(weights):  # mean over the calibration windows, as the report measures it
        head = fake_quant.int8_per_channel(weights["model.embed_tokens.weight"].float())
        student = ReferenceModel(ck.spec, norm_tuning.int4_simulated(weights, 32, int8))
        teacher = ReferenceModel(ck.spec, ck.weights)
        with torch.no_grad():
            embedding = ck.weights["model.embed_tokens.weight"]
            return sum(float(norm_tuning._kl(norm_tuning._log_probs(teacher, embedding, w),
                                             norm_tuning._log_probs(student, head, w))) for w in windows) / len(windows)

    # what the artifact stores, applied as the build applies it, is the model that was tuned
    assert kl(plain) == pytest.approx(report["kl_before"], rel=1e-3)  # the report's teacher is bfloat16
    assert kl(tuned) == pytest.approx(report["kl_after"], rel=1e-3)


def test_awq_without_norm_tuning_and_a_mismatched_gain(outlier_checkpoint):
    from kiln.calibration import norm_tuning

    ck = outlier_checkpoint
    config = CalibrationConfig("awq", 4, 64, 32, group_size=32, tune_norms=False)
    artifact = calibrate(ck, random_ids(400).tolist(), config)
    assert artifact.hyperparameters["norm_tuning"] is None and "norm_tuning" not in artifact.info
    assert not any(k.startswith(norm_tuning.GAIN_PREFIX) for k in artifact.scales)
    bad = dict(artifact.scales, **{f"{norm_tuning.GAIN_PREFIX}model.norm": torch.ones(7)})
    broken = CalibrationArtifact(artifact.method, artifact.model_fingerprint, artifact.hyperparameters, bad)
    with pytest.raises(CalibrationError, match="norm gains do not fit"):
        apply_artifact(ck, broken)


def test_awq_rounds_by_gptq_on_shared_hessians_and_the_build_keeps_its_codes(outlier_checkpoint, tmp_path):
    from kiln.calibration import gptq
    from kiln.calibration.collect import collect

    ck = outlier_checkpoint
    windows = [random_ids(64, seed=s) for s in range(2)]
    stats = collect(ReferenceModel.from_checkpoint(ck), windows, 8, hessians=True)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert stats.linears[f"{attn}.k_proj"].hessian is stats.linears[f"{attn}.q_proj"].hessian
    assert stats.linears[f"{mlp}.up_proj"].hessian is stats.linears[f"{mlp}.gate_proj"].hessian
    assert stats.linears[f"{attn}.o_proj"].hessian is not stats.linears[f"{attn}.q_proj"].hessian
    x = torch.cat([collect(ReferenceModel.from_checkpoint(ck), [w], 64).linears[f"{mlp}.down_proj"].sample_rows()
                   for w in windows])  # every row of down's input (64 per window)
    torch.testing.assert_close(stats.linears[f"{mlp}.down_proj"].hessian, x.T @ x, rtol=1e-4, atol=1e-3)

    config = CalibrationConfig("awq", 4, 64, 32, group_size=32, tune_norms=False, int8_fallback=1)
    artifact = CalibrationArtifact.load(calibrate(ck, random_ids(400).tolist(), config).save(tmp_path / "awq"))
    assert artifact.hyperparameters["rounding"] == "gptq"
    int8 = set(artifact.hyperparameters["int8_linears"])
    linears = {n[: -len(".weight")] for n in ck.weights if ".layers." in n and n.endswith("_proj.weight")}
    rounded = {n for n in linears if n.endswith(gptq.LINEARS)} - int8  # k/v keep RTN (gptq.py says why)
    assert set(gptq.linears_in(artifact.scales)) == rounded and int8 and len(rounded) >= 3 * ck.spec.num_layers
    assert all(artifact.scales[f"gptq.{n}.codes"].dtype == torch.uint8 for n in rounded)  # saved as packed codes
    applied = apply_artifact(ck, artifact).weights
    rtn_only = apply_artifact(ck, CalibrationArtifact("awq", artifact.model_fingerprint, artifact.hyperparameters,
                                                      {k: v for k, v in artifact.scales.items()
                                                       if not k.startswith(gptq.PREFIX)})).weights
    for linear in rounded:
        w = applied[f"{linear}.weight"].numpy()
        built = rtn.quantize_groupwise(w, 4, 32).dequantize()  # the build's int4 pass on these weights
        np.testing.assert_allclose(built, w, rtol=1e-6, atol=1e-9)
    for linear in linears - rounded:  # k/v and the fallback keep the folded fp32 weights for the build's passes
        torch.testing.assert_close(applied[f"{linear}.weight"], rtn_only[f"{linear}.weight"])
    changed = [n for n in rounded if not torch.equal(torch.from_numpy(rtn.quantize_groupwise(
        rtn_only[f"{n}.weight"].numpy(), 4, 32).dequantize()), applied[f"{n}.weight"])]
    assert len(changed) == len(rounded)  # GPTQ chose other codes than RTN everywhere

    plain = calibrate(ck, random_ids(400).tolist(), CalibrationConfig("awq", 4, 64, 32, group_size=32,
                                                                      tune_norms=False, rounding="rtn"))
    assert plain.hyperparameters["rounding"] == "rtn" and not gptq.linears_in(plain.scales)
    with pytest.raises(CalibrationError, match="unknown int4 rounding"):
        CalibrationConfig("awq", rounding="nearest")
