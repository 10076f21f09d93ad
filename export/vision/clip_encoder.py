"""LLaVA's image side as one plain PyTorch module, written for the exporter: CLIP ViT up to the feature layer,
CLS dropped, then the two-layer projector.

    pixel_values [N, 3, S, S] -> Conv(patch, stride patch, no bias) -> flatten -> [CLS; patches] + positions
      -> pre_layrnorm -> num_layers x (x + attn(ln1(x)); x + mlp(ln2(x)))            (hidden_states[layer])
      -> drop CLS -> linear_1 -> gelu -> linear_2                                    -> [N, tokens, text_hidden]

Parameter names are transformers' CLIPVisionTransformer's under ``tower.`` and LlavaMultiModalProjector's under
``projector.`` (export/vision/llava_config.vision_part), so the checkpoint loads with strict names; the
tower's unused post_layernorm and layers past the feature layer are not loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .frozen import adopt_weights
from .llava_config import ClipTowerSpec

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class _Embeddings(nn.Module):
    def __init__(self, spec: ClipTowerSpec):
        super().__init__()
        self.patch_size = spec.patch_size
        self.class_embedding = nn.Parameter(torch.empty(spec.hidden_size))
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size, spec.patch_size, spec.patch_size,
                                         bias=False)
        positions = (spec.image_size // spec.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(positions, spec.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [N, P, H]
        cls = self.class_embedding.expand(pixel_values.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, spec: ClipTowerSpec):
        super().__init__()
        size = spec.hidden_size
        self.num_heads, self.head_dim = spec.num_heads, size // spec.num_heads
        self.q_proj, self.k_proj = nn.Linear(size, size), nn.Linear(size, size)
        self.v_proj, self.out_proj = nn.Linear(size, size), nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, size = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        out = torch.matmul(torch.softmax(scores, dim=-1), v)  # bidirectional: every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, size))


class _Mlp(nn.Module):
    def __init__(self, spec: ClipTowerSpec):
        super().__init__()
        self.act = activation(spec.hidden_act)
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, spec: ClipTowerSpec):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = _Attention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = _Mlp(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, spec: ClipTowerSpec):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_layers))


class _Tower(nn.Module):
    def __init__(self, spec: ClipTowerSpec):
        super().__init__()
        self.embeddings = _Embeddings(spec)
        self.pre_layrnorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.encoder = _Encoder(spec)


class _Projector(nn.Module):
    def __init__(self, spec: ClipTowerSpec):
        super().__init__()
        self.linear_1 = nn.Linear(spec.hidden_size, spec.text_hidden_size, bias=spec.projector_bias)
        self.act = activation(spec.projector_act)
        self.linear_2 = nn.Linear(spec.text_hidden_size, spec.text_hidden_size, bias=spec.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ClipVisionEncoder(nn.Module):
    """forward(pixel_values [N, 3, S, S]) -> image embeddings [N, tokens_per_image, text_hidden]."""

    def __init__(self, spec: ClipTowerSpec, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        with torch.device("meta"):
            self.tower = _Tower(spec)
            self.projector = _Projector(spec)
        adopt_weights(self, weights)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.tower.pre_layrnorm(self.tower.embeddings(pixel_values))
        for layer in self.tower.encoder.layers:
            x = layer(x)
        if self.spec.drop_cls:
            x = x[:, 1:]
        return self.projector(x)


def encoder_weights(spec: ClipTowerSpec, weights) -> dict[str, torch.Tensor]:
    """The float32 tensors ClipVisionEncoder loads, read from vision_part's lazy weights: the layers up to the
    feature layer, without the tower's post_layernorm."""
    sources = weights.sources()
    wanted = {}
    for name in sources:
        if name.startswith("tower.post_layernorm.") or name.startswith("tower.embeddings.position_ids"):
            continue
        if name.startswith("tower.encoder.layers."):
            if int(name.split(".")[3]) >= spec.num_layers:
                continue
        wanted[name] = sources[name].read().to(torch.float32)
    return wanted
