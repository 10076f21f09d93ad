"""Gemma 3's image side as one plain PyTorch module, written for the exporter: the SigLIP tower, then
Gemma3MultiModalProjector.

    pixel_values [N, 3, S, S] -> Conv(patch, stride patch, bias) -> flatten -> + positions
      -> num_layers x (x + attn(ln1(x)); x + mlp(ln2(x))) -> post_layernorm            [N, P, H]
      -> average pool the side x side patch grid by k (k = side / sqrt(tokens))       [N, tokens, H]
      -> RMSNorm x (1 + w) (Gemma's, float32) -> @ mm_input_projection_weight        -> [N, tokens, text_hidden]

The SigLIP tower is siglip_encoder.py's (clip_encoder.py's layers; a patch conv with bias, no CLS, no pre-norm);
the positions are simply 0..P-1 (Gemma 3 feeds one full square image, no tiles, no patch mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .frozen import adopt_weights
from .gemma3_config import Gemma3TowerSpec
from .siglip_encoder import SiglipTower


class _SoftEmbNorm(nn.Module):
    def __init__(self, spec: Gemma3TowerSpec):
        super().__init__()
        self.eps = spec.layer_norm_eps
        self.weight = nn.Parameter(torch.empty(spec.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Gemma3RMSNorm
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())


class _Projector(nn.Module):
    def __init__(self, spec: Gemma3TowerSpec):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(spec.hidden_size, spec.text_hidden_size))
        self.mm_soft_emb_norm = _SoftEmbNorm(spec)


class Gemma3VisionEncoder(nn.Module):
    """forward(pixel_values [N, 3, S, S]) -> image embeddings [N, tokens_per_image, text_hidden]."""

    def __init__(self, spec: Gemma3TowerSpec, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        with torch.device("meta"):
            self.tower = SiglipTower(spec)
            self.projector = _Projector(spec)
        adopt_weights(self, weights)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        side = self.spec.patches_per_side
        x = self.tower(pixel_values, None)  # [N, P, H]
        grid = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], side, side)  # [N, H, side, side]
        pooled = F.avg_pool2d(grid, self.spec.pool_kernel).flatten(2).transpose(1, 2)  # [N, tokens, H]
        return torch.matmul(self.projector.mm_soft_emb_norm(pooled), self.projector.mm_input_projection_weight)


def encoder_weights(weights) -> dict[str, torch.Tensor]:
    """The float32 tensors Gemma3VisionEncoder loads, read from gemma3_config.vision_part's lazy weights."""
    return {name: source.read().to(torch.float32) for name, source in weights.sources().items()
            if not name.startswith("tower.embeddings.position_ids")}
