"""Idefics3 / SmolVLM's image side as one plain PyTorch module, written for the exporter: the SigLIP tower on one
tile, post_layernorm, then the connector (pixel shuffle, one linear projection).

    pixel_values [N, 3, S, S] -> Conv(patch, stride patch, bias) -> flatten -> + positions
      -> num_layers x (x + attn(ln1(x)); x + mlp(ln2(x))) -> post_layernorm             [N, P, H]
      -> pixel shuffle by scale s: [N, P / s^2, H * s^2] -> proj (no bias)               -> [N, tokens, text_hidden]

Every tile the processor makes is a full ``S x S`` image (resized to a multiple of the tile size, then cut), so no
patch is padding: the patch attention mask is all ones and the position ids are Idefics3VisionEmbeddings'
for a full tile, computed once here with the same float32 bucketing transformers does. The layers are the CLIP
ones of clip_encoder.py (SigLIP's differ only in the bias of the patch convolution, and no CLS or pre-norm).
"""

from __future__ import annotations

import torch
from torch import nn

from .clip_encoder import _Layer
from .frozen import adopt_weights
from .gemma3_config import Gemma3TowerSpec
from .idefics3_config import SiglipTowerSpec


def full_tile_position_ids(patches_per_side: int) -> torch.Tensor:
    """Idefics3VisionEmbeddings' position ids of a tile with every patch valid (int64 [patches])."""
    boundaries = torch.arange(1 / patches_per_side, 1.0, 1 / patches_per_side)
    step = torch.tensor([1.0 / patches_per_side])
    coords = torch.clamp(torch.arange(patches_per_side, dtype=torch.float32)[None, :] * step[:, None],
                         max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)[0]
    return (buckets[:, None] * patches_per_side + buckets[None, :]).reshape(-1)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """Idefics3Connector.pixel_shuffle: [N, P, H] -> [N, P / scale^2, H * scale^2], each output row the
    scale x scale block of neighbouring patches."""
    batch, length, size = x.shape
    side = int(length**0.5)
    x = x.reshape(batch, side, side // scale, size * scale).permute(0, 2, 1, 3)
    x = x.reshape(batch, side // scale, side // scale, size * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(batch, length // (scale * scale), size * scale * scale)


class _Embeddings(nn.Module):
    def __init__(self, spec: SiglipTowerSpec | Gemma3TowerSpec):
        super().__init__()
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size, spec.patch_size, spec.patch_size)
        self.position_embedding = nn.Embedding(spec.patches_per_side**2, spec.hidden_size)


class _Encoder(nn.Module):
    def __init__(self, spec: SiglipTowerSpec | Gemma3TowerSpec):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_layers))  # the CLIP layer: same fields


class SiglipTower(nn.Module):
    """The SigLIP tower, under transformers' module names (Gemma 3's is the same: gemma3_encoder.py)."""

    def __init__(self, spec: SiglipTowerSpec | Gemma3TowerSpec):
        super().__init__()
        self.embeddings = _Embeddings(spec)
        self.encoder = _Encoder(spec)
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """[N, 3, S, S] -> post-layernorm patch features [N, P, H]; position_ids None: 0..P-1."""
        x = self.embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [N, P, H]
        positions = self.embeddings.position_embedding.weight
        x = x + (positions if position_ids is None else positions[position_ids])
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class _Projector(nn.Module):
    def __init__(self, spec: SiglipTowerSpec):
        super().__init__()
        self.proj = nn.Linear(spec.hidden_size * spec.scale_factor**2, spec.text_hidden_size, bias=False)


class SiglipVisionEncoder(nn.Module):
    """forward(pixel_values [N, 3, S, S]) -> image embeddings [N, tokens_per_image, text_hidden]."""

    def __init__(self, spec: SiglipTowerSpec, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        with torch.device("meta"):
            self.tower = SiglipTower(spec)
            self.projector = _Projector(spec)
        adopt_weights(self, weights)
        self.register_buffer("position_ids", full_tile_position_ids(spec.patches_per_side), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.tower(pixel_values, self.position_ids)
        return self.projector.proj(pixel_shuffle(x, self.spec.scale_factor))


def encoder_weights(weights) -> dict[str, torch.Tensor]:
    """The float32 tensors SiglipVisionEncoder loads, read from idefics3_config.vision_part's lazy weights."""
    sources = weights.sources()
    return {name: source.read().to(torch.float32) for name, source in sources.items()
            if not name.startswith("tower.embeddings.position_ids")}
