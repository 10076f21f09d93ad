"""Checkpoints that store fused projections, split into the per-projection weights kiln's reference model
names (the optimizer fuses them again where it pays, with its own layout).

Phi-3 / Phi-4 keep ``self_attn.qkv_proj`` ([q; k; v] rows) and ``mlp.gate_up_proj`` ([gate; up] rows,
the order transformers' ``chunk(2)`` reads them in). Both Hugging Face and GGUF sources pass through here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from kiln.spec import ModelSpec

from .checkpoint_types import LazyWeights
from .tensor_files import RowSlice

_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")


def split_fused_projections(spec: ModelSpec, weights: Mapping[str, torch.Tensor], source: str
                            ) -> Mapping[str, torch.Tensor]:
    """weights with every fused qkv_proj / gate_up_proj replaced by its parts (others untouched). Lazy
    weights stay lazy: each part is a view that reads its rows of the fused tensor when asked for."""
    lazy = isinstance(weights, LazyWeights)
    items: Mapping[str, Any] = weights.sources() if isinstance(weights, LazyWeights) else weights
    out: dict[str, Any] = {}
    for name, tensor in items.items():
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
        start = 0
        for part, size in parts.items():
            out[f"{prefix}{part}.{kind}"] = RowSlice(tensor, start, size) if lazy else tensor[start:start + size]
            start += size
    return LazyWeights(out) if lazy else out
