"""Encoders wrapped around a checkpoint's own tensors: their parts are made on the meta device (nothing allocated,
nothing drawn at random), then take the checkpoint's tensors as their parameters, frozen for tracing."""

from __future__ import annotations

import torch
from torch import nn


def adopt_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """module's meta parameters become weights' tensors (every name must match: strict), no copy; then frozen."""
    module.load_state_dict(weights, strict=True, assign=True)
    module.requires_grad_(False)
    module.eval()
