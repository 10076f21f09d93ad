"""Which decoder linears to keep int8 in an int4 build: the estimated loss each one's int4 rounding costs.

A unit is what the engine quantizes as one MatMul after projection fusion (optimize/fuse_projections.py):
per layer q/k/v (one fused MatMul), o, gate/up (fused) and down. Its int4 rounding changes each token's
loss by, to first order, ``dL_t = sum over the unit's parts of g_t . (dW x_t)`` where ``g_t`` is the
gradient of the token's loss with respect to the part's output, ``x_t`` its input and
``dW = Q_int4(W) - W``; the expected loss increase is about half the mean of ``dL_t^2`` (the empirical
Fisher in output space, per token, so no cross-token cancellation). The scores are measured on the
calibration windows with the weights exactly as the build will quantize them (AWQ scales folded, clips
applied), and the units with the largest scores become int8 per channel (``int8_linears`` in the
artifact; the int4 pass reads it, the norm tuning simulates it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.export.progress import track

from .fake_quant import int4_groupwise

UNIT_PARTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def units(num_layers: int) -> list[tuple[str, ...]]:
    """The decoder's quantization units (module names; fused parts together), layer by layer."""
    return [tuple(f"model.layers.{i}.{p}" for p in parts) for i in range(num_layers) for parts in UNIT_PARTS]


def unit_scores(spec, weights: dict[str, torch.Tensor], windows: list[torch.Tensor], group_size: int,
                progress: Callable[[str], None] | None = None) -> dict[tuple[str, ...], float]:
    """Estimated loss increase (nats per token) of rounding each unit alone to int4 RTN groups of group_size."""
    from kiln.export.reference import ReferenceModel

    model = ReferenceModel(spec, weights)
    all_units = units(spec.num_layers)
    delta = {name: int4_groupwise(weights[f"{name}.weight"].float(), group_size) - weights[f"{name}.weight"].float()
             for unit in all_units for name in unit}
    scores = dict.fromkeys(all_units, 0.0)
    tokens = 0
    for ids in track(windows, "int8 fallback scores", "window"):
        terms = first_order_terms(model, delta, all_units, ids)
        for unit, d in terms.items():
            scores[unit] += 0.5 * float((d**2).sum())
        tokens += ids.numel() - 1
    if progress:
        progress(f"int8 fallback scores on {tokens} tokens")
    return {unit: s / max(tokens, 1) for unit, s in scores.items()}


def first_order_terms(model: nn.Module, delta: dict[str, torch.Tensor], all_units: list[tuple[str, ...]],
                      ids: torch.Tensor) -> dict[tuple[str, ...], torch.Tensor]:
    """Per unit, [T] the first-order change of the window's summed next-token loss at each position when
    the unit's weights move by delta (module -> dW [N, K]): sum over its parts of g_t . (dW x_t). Summed
    over t it is the directional derivative of the loss along delta."""
    inputs: dict[str, torch.Tensor] = {}
    terms: dict[str, torch.Tensor] = {}

    def on_forward(name: str):
        def hook(_module, args, out):
            x = args[0].detach()[0]
            inputs[name] = x
            out.register_hook(lambda g: terms.__setitem__(name, (g[0] * (x @ delta[name].T)).sum(-1)))
        return hook

    hooks = [model.get_submodule(name).register_forward_hook(on_forward(name)) for unit in all_units for name in unit]
    try:
        x = model.embed(ids[None]).requires_grad_(True)  # the weights need no gradient
        y = model.run_layers(x, torch.arange(ids.numel())[None])
        logits = model.logits(model.model.norm(y)[0])
        F.cross_entropy(logits[:-1], ids[1:], reduction="sum").backward()
    finally:
        for h in hooks:
            h.remove()
    return {unit: sum(terms[name] for name in unit)[:-1] for unit in all_units}  # the last row predicts nothing


def most_sensitive(scores: dict[tuple[str, ...], float], count: int) -> list[tuple[str, ...]]:
    """The `count` units of largest estimated loss increase, largest first."""
    return sorted(scores, key=lambda u: -scores[u])[:count]
