"""Checkpoints that store fused projections, split into the per-projection weights kiln's reference model
names (the optimizer fuses them again where it pays, with its own layout).

Phi-3 / Phi-4 keep ``self_attn.qkv_proj`` ([q; k; v] rows) and ``mlp.gate_up_proj`` ([gate; up] rows,
the order transformers' ``chunk(2)`` reads them in). Both Hugging Face and GGUF sources pass through here.
"""

from __future__ import annotations

import re

import torch

from kiln.spec import ModelSpec

_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")


def split_fused_projections(spec: ModelSpec, weights: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """weights with every fused qkv_proj / gate_up_proj replaced by its parts (others untouched)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, fused, kind = match.groups()
        if fused == "self_attn.qkv_proj":
            parts = {"self_attn.q_proj": spec.q_size, "self_attn.k_proj": spec.kv_size,
                     "self_attn.v_proj": spec.kv_size}
        else:
            parts = {"mlp.gate_proj": spec.intermediate_size, "mlp.up_proj": spec.intermediate_size}
        rows = sum(parts.values())
        if tensor.shape[0] != rows:
            split = " + ".join(f"{part.rsplit('.', 1)[-1]} {size}" for part, size in parts.items())
            raise ValueError(f"{source}: {name} has {tensor.shape[0]} rows, the config implies {rows} ({split})")
        for part, piece in zip(parts, torch.split(tensor, list(parts.values())), strict=True):
            out[f"{prefix}{part}.{kind}"] = piece
    return out
