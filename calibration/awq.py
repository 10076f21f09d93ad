"""AWQ (activation-aware weight quantization) scales for int4 group-wise weights.

Per smoothing group: s = mean|x|^r, normalised to geometric mid-range 1, for r on RATIO_GRID;
the r whose int4 simulation ``(x / s) @ Q(W * s)^T`` is closest to ``x @ W^T`` on the
calibration rows wins (r = 0 is plain RTN, so AWQ is never worse on those rows).
"""

from __future__ import annotations

import torch

from .collect import ActivationStats
from .fake_quant import int4_groupwise
from .smoothing import SmoothGroup

RATIO_GRID = tuple(i / 20 for i in range(20))


def awq_scales(mean_abs: torch.Tensor, ratio: float) -> torch.Tensor:
    s = mean_abs.clamp_min(1e-4).pow(ratio)
    return s / (s.max() * s.min()).sqrt()


def int4_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, group_size: int,
               exact: list[torch.Tensor] | None = None) -> float:
    """Squared output error of int4 group-wise weights with AWQ scales s, summed over the group."""
    xs = x / s
    exact = exact or [x @ w.T for w in weights]
    return sum(float(((xs @ int4_groupwise(w * s, group_size).T - y) ** 2).sum()) for w, y in zip(weights, exact))


def search(groups: list[SmoothGroup], stats: ActivationStats, weights: dict[str, torch.Tensor],
           group_size: int) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(scales by group name, per-group report {ratio, error, error_rtn})."""
    scales, report = {}, {}
    for group in groups:
        first = stats.linears[group.linears[0]]
        ws = [weights[f"{name}.weight"] for name in group.linears]
        x = first.sample_rows()
        exact = [x @ w.T for w in ws]
        mean_abs = first.mean_abs
        best = None
        rtn_err = None
        for r in RATIO_GRID:
            s = awq_scales(mean_abs, r)
            err = int4_error(x, ws, s, group_size, exact)
            if r == 0:
                rtn_err = err
            if best is None or err < best[2]:
                best = (r, s, err)
        scales[group.name] = best[1]
        report[group.name] = {"ratio": best[0], "error": best[2], "error_rtn": rtn_err}
    return scales, report
