"""Torch versions of the quantizers the ONNX passes apply (kiln.optimize.quant.rtn is the spec),
used by the scale searches to measure the error a choice of scales would give."""

from __future__ import annotations

import torch


def int8_per_channel(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output row of w [N, K], dequantized."""
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    return torch.clamp(torch.round(w / scale), -127, 127) * scale


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per row of x [T, K] (the W8A8 pass's dynamic activation quantization)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0)
    return torch.clamp(torch.round(x / scale), -127, 127) * scale


def int4_groupwise(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Asymmetric int4 RTN per group of `group_size` along K (range includes 0), dequantized."""
    n, k = w.shape
    pad = -k % group_size
    g = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, group_size)
    lo = g.amin(-1, keepdim=True).clamp_max(0)
    hi = g.amax(-1, keepdim=True).clamp_min(0)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zp = torch.clamp(torch.round(-lo / scale), 0, 15)
    q = torch.clamp(torch.round(g / scale) + zp, 0, 15)
    return ((q - zp) * scale).reshape(n, -1)[:, :k]
