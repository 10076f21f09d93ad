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


def int4_grid(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) of asymmetric int4 over the last axis of groups [..., group_size], the range
    including 0 (zero padding is inert)."""
    lo = groups.amin(-1).clamp_max(0)
    hi = groups.amax(-1).clamp_min(0)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale, torch.clamp(torch.round(-lo / scale), 0, 15)


def int4_codes(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The int4 codes (as floats 0..15) of groups [..., group_size] on the grid (scale, zero) [...]."""
    return torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, 15)


def int4_groupwise(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Asymmetric int4 RTN per group of `group_size` along K (range includes 0), dequantized."""
    n, k = w.shape
    pad = -k % group_size
    g = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, group_size)
    scale, zp = int4_grid(g)
    q = int4_codes(g, scale, zp)
    return ((q - zp[..., None]) * scale[..., None]).reshape(n, -1)[:, :k]


def q4_1(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_1 over the last axis of w [..., K] (blocks of 32, float16 step and minimum: kiln.MoE's int4
    experts), dequantized."""
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15.0).half().float()[..., None]
    m = lo.half().float()[..., None]
    q = torch.where(d > 0, torch.round((blocks - m) / d), 0.0).clamp(0, 15)
    return (q * d + m).reshape(w.shape)
