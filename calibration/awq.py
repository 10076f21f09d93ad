"""AWQ (activation-aware weight quantization) scales for int4 group-wise weights.

Per smoothing group: s = mean|x|^r, normalised to geometric mid-range 1, for r on RATIO_GRID;
the r whose int4 simulation ``(x / s) @ Q(W * s)^T`` is closest to ``x @ W^T`` on the
calibration rows wins (r = 0 is plain RTN, so AWQ is never worse on those rows).

Then AWQ's weight clipping (the paper's auto_clip): per linear, per output channel and group of
K, the max-abs clip ratio c on CLIP_GRID (1.0 = no clip .. 0.55) whose int4 RTN of
``clamp(W * s, -c * max|W * s|, c * max|W * s|)`` best reproduces that group's share of the output
``(x / s)_g @ (W * s)_g^T`` on the calibration rows. Ratios, not absolute bounds, are stored
(``clip.<linear>`` [N, n_groups] in the artifact): a positive per-row factor folded in later (up_proj's
and v_proj's rows are divided by the next group's scales) commutes with both the clip and RTN.
Only v_proj and o_proj are clipped (CLIP_LINEARS). q/k are not, as in AWQ (the attention dot product
amplifies their error). The MLP is not, measured on SmolLM2-135M (int4 g128, Persuasion): clipping
down_proj took perplexity from 53.4 to 59.1 although it lowered the sampled output error by a
quarter. AWQ's scales make the salient input channels' weights the largest of their groups, so a
clip trims exactly them, and the rare tokens with massive down_proj inputs that depend on them are
hardly ever among the sampled rows; gate/up clips cost 0.3-0.5 more. v/o clips gain ~1.0.
"""

from __future__ import annotations

import torch

from kiln.export.progress import track

from .collect import ActivationStats
from .fake_quant import int4_groupwise
from .smoothing import SmoothGroup

RATIO_GRID = tuple(i / 20 for i in range(20))
CLIP_GRID = tuple(1 - i / 20 for i in range(10))  # AWQ: 20-step grid, shrink to at most half
CLIP_PREFIX = "clip."
CLIP_LINEARS = ("self_attn.v_proj", "self_attn.o_proj")


def awq_scales(mean_abs: torch.Tensor, ratio: float) -> torch.Tensor:
    s = mean_abs.clamp_min(1e-4).pow(ratio)
    return s / (s.max() * s.min()).sqrt()


def int4_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, group_size: int,
               exact: list[torch.Tensor] | None = None) -> float:
    """Squared output error of int4 group-wise weights with AWQ scales s, summed over the group."""
    xs = x / s
    exact = exact or [x @ w.T for w in weights]
    return sum(float(((xs @ int4_groupwise(w * s, group_size).T - y) ** 2).sum())
               for w, y in zip(weights, exact, strict=True))


def search(groups: list[SmoothGroup], stats: ActivationStats, weights: dict[str, torch.Tensor],
           group_size: int) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(scales by group name, per-group report {ratio, error, error_rtn})."""
    scales, report = {}, {}
    for group in track(groups, "awq scales", "group"):
        first = stats.linears[group.linears[0]]
        ws = [weights[f"{name}.weight"] for name in group.linears]
        x = first.sample_rows()
        exact = [x @ w.T for w in ws]
        mean_abs = group.tie(first.mean_abs)  # tied under GQA (o_proj): awq_scales keeps the tie
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


def _grouped(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., K] -> [..., n_groups, group_size], zero padded (as the int4 pass pads)."""
    pad = -t.shape[-1] % group_size
    t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(*t.shape[:-1], -1, group_size)


def apply_clip(w: torch.Tensor, ratio: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] clamped per (row, group) to +-ratio * the group's max |w|; ratio [N, n_groups]."""
    n, k = w.shape
    g = _grouped(w, group_size)
    bound = (g.abs().amax(-1) * ratio.to(g.dtype))[..., None]
    return torch.maximum(torch.minimum(g, bound), -bound).reshape(n, -1)[:, :k]


def clip_search(x: torch.Tensor, w: torch.Tensor, group_size: int,
                grid: tuple[float, ...] = CLIP_GRID) -> tuple[torch.Tensor, dict]:
    """Per (output channel, group) clip ratio of w [N, K] minimising the int4 error of that group's
    partial output on rows x [T, K]; returns (ratios [N, n_groups], {error, error_noclip}) where the
    errors are the squared output error ``|x @ (Q(clip(w)) - w)^T|^2`` of the whole layer."""
    n, k = w.shape
    xg = _grouped(x, group_size).transpose(0, 1)  # [G, T, gs]
    wg = _grouped(w, group_size)  # [N, G, gs]
    best_err = torch.full(wg.shape[:2], float("inf"))
    best = torch.ones(wg.shape[:2])
    for c in grid:
        ratio = torch.full(wg.shape[:2], c)
        q = _grouped(int4_groupwise(apply_clip(w, ratio, group_size), group_size), group_size)
        d = (q - wg).transpose(0, 1)  # [G, N, gs]
        err = torch.bmm(xg, d.transpose(1, 2)).pow(2).sum(1).T  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, ratio, best)

    def layer_error(ratio):
        return float(((x @ (int4_groupwise(apply_clip(w, ratio, group_size), group_size) - w).T) ** 2).sum())

    return best, {"error": layer_error(best), "error_noclip": layer_error(torch.ones_like(best)),
                  "mean_ratio": float(best.mean())}


def clip_all(groups: list[SmoothGroup], stats: ActivationStats, weights: dict[str, torch.Tensor],
             scales: dict[str, torch.Tensor], group_size: int) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Clip ratios ({CLIP_PREFIX}<linear>) for the decoder linears named by CLIP_LINEARS, searched on the
    AWQ-scaled weights and inputs (linears outside any smoothing group, e.g. o_proj under GQA, as they are)."""
    scale_of = {lin: scales[g.name] for g in groups if g.name in scales for lin in g.linears}
    clips, report = {}, {}
    for name, st in track(stats.linears.items(), "awq clips", "linear", len(stats.linears)):
        if not name.endswith(CLIP_LINEARS) or f"{name}.weight" not in weights:
            continue
        x, w = st.sample_rows(), weights[f"{name}.weight"]
        if x.shape[0] == 0:
            continue
        s = scale_of.get(name)
        if s is not None:
            x, w = x / s, w * s[None, :]
        ratio, rep = clip_search(x, w, group_size)
        if rep["error"] < rep["error_noclip"]:  # whole-layer check of the per-group choice
            clips[CLIP_PREFIX + name] = ratio
            report[name] = rep
        else:
            report[name] = {**rep, "error": rep["error_noclip"], "mean_ratio": 1.0, "rejected": True}
    return clips, report


def apply_clips(weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
                group_size: int) -> dict[str, torch.Tensor]:
    """A new weight dict with every {CLIP_PREFIX}<linear> ratio table applied to <linear>.weight."""
    out = dict(weights)
    for key, ratio in scales.items():
        if key.startswith(CLIP_PREFIX):
            name = f"{key[len(CLIP_PREFIX):]}.weight"
            out[name] = apply_clip(out[name].float(), ratio, group_size)
    return out
