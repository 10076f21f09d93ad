"""AWQ scales for a mixture-of-experts layer's MLP (kiln.MoE), the groups smoothing.py defines for it.

The build stores routed experts as Q4_1 (optimize/quantize_moe.py: blocks of 32 along K, whatever the scheme's group
size), so the searches simulate Q4_1 (fake_quant.q4_1) on each expert, measured on the calibration rows routed to it
(the router's top-k, as kiln.MoE chooses):

- the MLP's input group (``mlp.gate_up``): one s [D] for every expert's gate/up rows, the router and a shared
  expert's linears, since they all read the normalised hidden state; its error is the experts' gate/up output error on
  their own rows plus the shared expert's gate/up error as int4 groups of the scheme (the router and the shared
  expert's gate stay float32: exact under any s);
- each expert's down projection (``mlp.experts.down``): s[e] [F] searched on that expert's own inputs, silu(gate) *
  up of the rows routed to it, over the ratio grid expert by expert.

r = 0 (no scaling) is on the grid, so each choice is never worse than plain Q4_1 on those rows. An expert whose
width is not whole blocks of 32 stays float32 in the build: its scales stay 1.
"""

from __future__ import annotations

import torch

from kiln.export.moe import expert_activations
from kiln.export.progress import track

from .awq import RATIO_GRID, awq_scales, int4_error
from .collect import ActivationStats, routed_rows
from .fake_quant import q4_1
from .smoothing import ExpertDownGroup, Group, SmoothGroup

Q4_1_BLOCK = 32


def is_moe_group(group: Group) -> bool:
    """A group this module searches (kiln.MoE's experts) rather than awq.search."""
    return isinstance(group, ExpertDownGroup) or bool(getattr(group, "stacks", ()))


def search(groups: list[Group], stats: ActivationStats, weights: dict[str, torch.Tensor], group_size: int,
           top_k: int) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(scales by group name, per-group report {ratio(s), error, error_rtn}) for the MoE groups among `groups`."""
    scales, report = {}, {}
    for group in track([g for g in groups if is_moe_group(g)], "awq expert scales", "group"):
        if isinstance(group, ExpertDownGroup):
            scales[group.name], report[group.name] = _search_down(group, stats, weights, top_k)
        else:
            assert isinstance(group, SmoothGroup)
            scales[group.name], report[group.name] = _search_input(group, stats, weights, group_size, top_k)
    return scales, report


def _experts_error(xs: torch.Tensor, quantized: torch.Tensor, rows: list[torch.Tensor],
                   exact: list[torch.Tensor]) -> float:
    """Squared error of each expert's output on its rows: xs [T, K] (scaled inputs), quantized [E, N, K]."""
    total = 0.0
    for e, (idx, y) in enumerate(zip(rows, exact, strict=True)):
        total += float(((xs[idx] @ quantized[e].T - y) ** 2).sum())
    return total


def _search_input(group: SmoothGroup, stats: ActivationStats, weights: dict[str, torch.Tensor], group_size: int,
                  top_k: int) -> tuple[torch.Tensor, dict]:
    router = group.linears[0]
    first = stats.linears[router]
    x = first.sample_rows()
    stack = weights[group.stacks[0]]
    rows = routed_rows(x, weights[f"{router}.weight"], top_k)
    exact = [x[idx] @ stack[e].T for e, idx in enumerate(rows)]
    shared = [weights[f"{name}.weight"] for name in group.linears if name.endswith(("gate_proj", "up_proj"))]
    shared_exact = [x @ w.T for w in shared]
    quantized = stack.shape[-1] % Q4_1_BLOCK == 0
    best: tuple[float, torch.Tensor, float] | None = None
    rtn_err = 0.0
    for r in RATIO_GRID:
        s = awq_scales(first.mean_abs, r)
        err = int4_error(x, shared, s, group_size, shared_exact) if shared else 0.0
        if quantized:
            err += _experts_error(x / s, q4_1(stack * s), rows, exact)
        if r == 0:
            rtn_err = err
        if best is None or err < best[2]:
            best = (r, s, err)
    assert best is not None
    return best[1], {"ratio": best[0], "error": best[2], "error_rtn": rtn_err}


def _search_down(group: ExpertDownGroup, stats: ActivationStats, weights: dict[str, torch.Tensor],
                 top_k: int) -> tuple[torch.Tensor, dict]:
    x = stats.linears[group.router].sample_rows()
    gate_up, down = weights[group.gate_up], weights[group.down]
    rows = routed_rows(x, weights[f"{group.router}.weight"], top_k)
    inputs = [expert_activations(x[idx], gate_up[e]) for e, idx in enumerate(rows)]
    exact = [a @ down[e].T for e, a in enumerate(inputs)]
    mean_abs = stats.experts[group.down.rsplit(".", 1)[0]].mean_abs  # [E, F]
    experts = down.shape[0]
    s = torch.ones(experts, down.shape[2])
    errors = torch.full((experts,), float("inf"))
    ratios = [0.0] * experts
    if down.shape[2] % Q4_1_BLOCK:
        return s, {"ratios": ratios, "error": 0.0, "error_rtn": 0.0}
    rtn = torch.zeros(experts)
    for r in RATIO_GRID:
        candidate = torch.stack([awq_scales(m, r) for m in mean_abs])  # [E, F]
        quantized = q4_1(down * candidate[:, None, :])
        for e, (a, y) in enumerate(zip(inputs, exact, strict=True)):
            err = float(((a / candidate[e] @ quantized[e].T - y) ** 2).sum())
            if r == 0:
                rtn[e] = err
            if err < errors[e]:
                errors[e], s[e], ratios[e] = err, candidate[e], r
    return s, {"ratios": ratios, "error": float(errors.sum()), "error_rtn": float(rtn.sum())}
