"""GPTQ rounding: on the build's int4 grid (a fixed point of its RTN), lower output error than RTN, the
artifact's packing, and calibration's use of it (Hessians shared by q/k/v, the int8 fallback skipped)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.calibration import gptq
from kiln.calibration.fake_quant import int4_groupwise
from kiln.optimize.quant.rtn import quantize_groupwise


def output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    """|x @ (q - w)^T|^2 summed: the layer's squared output error on rows x [T, K]."""
    return float(((x @ (q - w).T) ** 2).sum())


def correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows that live near a low-rank subspace, two channels 20x larger: what makes RTN's error large."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=gen) @ torch.randn(8, k, generator=gen)
    x += 0.3 * torch.randn(rows, k, generator=gen)
    x[:, :2] *= 20
    return x


@pytest.mark.parametrize("k,group", [(96, 32), (80, 32), (256, 128), (200, 64)])
def test_gptq_weights_are_a_fixed_point_of_the_builds_rounding(k, group):
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(1)) * 0.05
    x = correlated_inputs(512, k)
    q = gptq.gptq_quantize(w, x.T @ x, group)
    built = quantize_groupwise(q.numpy(), 4, group)  # what the int4 pass does with these weights
    np.testing.assert_allclose(built.dequantize(), q.numpy(), rtol=1e-6, atol=1e-9)
    assert (built.q.reshape(24, -1, group).max(-1) == 15).any()  # really int4 groups, extremes included
    assert not torch.equal(q, int4_groupwise(w, group))  # and not RTN's choices


def test_gptq_lowers_the_output_error_on_inputs_like_those_it_saw():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    rows = correlated_inputs(1280, 128)
    seen, held_out = rows[:1024], rows[1024:]
    rtn, ours = int4_groupwise(w, 32), gptq.gptq_quantize(w, seen.T @ seen, 32)
    assert output_error(seen, w, ours) < 0.5 * output_error(seen, w, rtn)
    assert output_error(held_out, w, ours) < 0.5 * output_error(held_out, w, rtn)


def test_gptq_needs_groups_that_tile_its_block():
    with pytest.raises(ValueError, match="must divide"):
        gptq.gptq_quantize(torch.zeros(4, 96), torch.eye(96), 96)


def test_dead_input_channels_do_not_break_the_factorisation():
    x = correlated_inputs(256, 64)
    x[:, 5] = 0  # a channel that never fired
    q = gptq.gptq_quantize(torch.randn(8, 64) * 0.05, x.T @ x, 32)
    assert torch.isfinite(q).all()


def test_pack_and_unpack_give_the_same_codes():
    w = torch.randn(12, 80, generator=torch.Generator().manual_seed(4)) * 0.05
    q = gptq.gptq_quantize(w, torch.eye(80) + 0.1, 32)
    entries = gptq.pack("layer.proj", q, 32)
    assert entries["gptq.layer.proj.codes"].dtype == torch.uint8 and entries["gptq.layer.proj.codes"].shape == (12, 48)
    assert gptq.linears_in(entries) == ["layer.proj"]
    torch.testing.assert_close(gptq.unpack(entries, "layer.proj", 80), q, rtol=1e-6, atol=1e-9)


def test_kiln_calibrate_takes_the_rounding(tmp_path):
    import json

    from click.testing import CliRunner
    from helpers import make_tiny_hf_model

    from kiln.calibration.artifact import CalibrationArtifact
    from kiln.cli.calibration import calibrate

    model = make_tiny_hf_model(tmp_path, "llama")
    text = tmp_path / "mine.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 40)
    base = [str(model), "--method", "awq", "--group-size", "32", "--windows", "2", "--window-tokens", "64",
            "--no-tune-norms", "--calibration-text", str(text)]
    for rounding, has_codes in (("rtn", False), ("gptq", True)):
        out = tmp_path / rounding
        result = CliRunner().invoke(calibrate, [*base, "--rounding", rounding, "-o", str(out)])
        assert result.exit_code == 0, result.output
        meta = json.loads((out / "calibration.json").read_text())
        assert meta["hyperparameters"]["rounding"] == rounding
        assert bool(gptq.linears_in(CalibrationArtifact.load(out).scales)) == has_codes
    result = CliRunner().invoke(calibrate, [*base, "--rounding", "nearest", "-o", str(tmp_path / "x")])
    assert result.exit_code != 0 and "nearest" in result.output


def test_hessians_that_would_not_fit_are_refused_before_any_work(monkeypatch, tmp_path):
    from helpers import make_tiny_hf_model

    from kiln.calibration import calibrate as calibration
    from kiln.calibration.artifact import CalibrationError
    from kiln.calibration.calibrate import CalibrationConfig
    from kiln.export.checkpoint import load_checkpoint

    ck = load_checkpoint(make_tiny_hf_model(tmp_path, "llama"))
    spec = ck.spec
    assert gptq.hessian_bytes(spec) == 4 * spec.num_layers * (2 * spec.hidden_size**2 + spec.q_size**2
                                                               + spec.intermediate_size**2)
    monkeypatch.setattr(calibration, "physical_memory", lambda: gptq.hessian_bytes(spec))  # half would not do
    monkeypatch.setattr(calibration, "collect", lambda *a, **kw: pytest.fail("collected before refusing"))
    with pytest.raises(CalibrationError, match=r"GiB of input Hessians .* --rounding rtn"):
        calibration.calibrate(ck, list(range(3, 200)), CalibrationConfig("awq", 2, 64, 8, group_size=32))
    calibration.check_gptq_memory(spec, 2 * gptq.hessian_bytes(spec))  # exactly half: allowed
