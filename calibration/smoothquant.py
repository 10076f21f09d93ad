"""SmoothQuant scales: s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha), per smoothing group.

alpha is given, or searched per group over ALPHA_GRID: the one whose W8A8 simulation
(per-token int8 activations x per-channel int8 weights, as the W8A8 pass computes) gives the
smallest output error on the calibration rows, with "no smoothing" (s = 1) as a candidate.
"""

from __future__ import annotations

import torch

from kiln.export.progress import track

from .collect import ActivationStats
from .fake_quant import int8_per_channel, int8_per_token
from .smoothing import SmoothGroup

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(1, 10))


def smoothquant_scales(x_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    w_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = x_absmax.clamp_min(1e-5).pow(alpha) / w_absmax.clamp_min(1e-5).pow(1 - alpha)
    return s.clamp(1e-5, 1e5)


def w8a8_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor,
               exact: list[torch.Tensor] | None = None) -> float:
    """Squared output error of the W8A8 simulation with smoothing s, summed over the group."""
    xq = int8_per_token(x / s)
    exact = exact or [x @ w.T for w in weights]
    return sum(float(((xq @ int8_per_channel(w * s).T - y) ** 2).sum()) for w, y in zip(weights, exact, strict=True))


def search(groups: list[SmoothGroup], stats: ActivationStats, weights: dict[str, torch.Tensor],
           alpha: float | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(scales by group name, per-group report {alpha, error, error_unsmoothed})."""
    scales, report = {}, {}
    for group in track(groups, "smoothquant scales", "group"):
        first = stats.linears[group.linears[0]]
        ws = [weights[f"{name}.weight"] for name in group.linears]
        if alpha is not None:
            scales[group.name] = smoothquant_scales(first.absmax, ws, alpha)
            report[group.name] = {"alpha": alpha}
            continue
        x = first.sample_rows()
        exact = [x @ w.T for w in ws]
        ones = torch.ones_like(first.absmax)
        best_alpha, best_s, best_err = None, ones, w8a8_error(x, ws, ones, exact)
        base_err = best_err
        for a in ALPHA_GRID:
            s = smoothquant_scales(first.absmax, ws, a)
            err = w8a8_error(x, ws, s, exact)
            if err < best_err:
                best_alpha, best_s, best_err = a, s, err
        scales[group.name] = best_s
        report[group.name] = {"alpha": best_alpha, "error": best_err, "error_unsmoothed": base_err}
    return scales, report
