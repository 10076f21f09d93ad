"""LLaVA-NeXT's image side for the exporter: LLaVA's CLIP encoder + projector on each tile (clip_encoder.py), and
the learned ``image_newline`` vector as the graph's second output.

The tiles' features are packed per image at run time (kiln.runtime.vision.llava_next: spatial re-arrangement,
unpadding, a newline row after each feature row), because how depends on the image's size, not on the pixels; the
graph stays one batch of equal tiles, and the runtime reads the newline from the same run.
"""

from __future__ import annotations

import torch
from torch import nn

from .clip_encoder import ClipVisionEncoder
from .llava_config import ClipTowerSpec
from .llava_next_config import NEWLINE


class LlavaNextVisionEncoder(ClipVisionEncoder):
    """forward(pixel_values [N, 3, S, S]) -> (tile embeddings [N, tokens_per_tile, text_hidden],
    image_newline [text_hidden])."""

    def __init__(self, spec: ClipTowerSpec, weights: dict[str, torch.Tensor]):
        weights = dict(weights)
        newline = weights.pop(NEWLINE)
        super().__init__(spec, weights)
        self.image_newline = nn.Parameter(newline.to(torch.float32), requires_grad=False)

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(pixel_values), self.image_newline
