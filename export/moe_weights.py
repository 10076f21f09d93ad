"""Per-expert checkpoint weights, stacked into the [E, ...] tensors kiln.MoE reads (export/moe.py).

Hugging Face checkpoints of every MoE family keep one Linear per expert and projection:
``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`` (Qwen2/3-MoE, OLMoE) or
``block_sparse_moe.experts.{j}.w1/w3/w2.weight`` with the router at ``block_sparse_moe.gate`` (Mixtral). They become
``mlp.gate.weight`` [E, D], ``mlp.experts.gate_up_proj`` [E, 2F, D] (each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` [E, D, F]. Lazy weights stay lazy: a stacked tensor reads its experts' tensors when the
build asks for it, one layer's experts at a time. Checkpoints already stacked (transformers >= 5's own layout) pass
through.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.spec import ModelSpec

from .checkpoint_types import LazyWeights, TensorSource

_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")


@dataclass(frozen=True)
class _Tensor:
    """An in-memory tensor as a TensorSource."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self) -> torch.Tensor:
        return self.tensor


@dataclass(frozen=True)
class StackedExperts:
    """[E, rows, cols]: expert j's tensors concatenated along rows (gate then up), stacked over j; read on demand."""

    parts: tuple[tuple[TensorSource, ...], ...]  # per expert, the tensors its rows are made of

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0]
        return (len(self.parts), sum(p.shape[0] for p in first), *tuple(first[0].shape)[1:])

    def read(self) -> torch.Tensor:
        return torch.stack([torch.cat([p.read().to(torch.float32) for p in expert]) for expert in self.parts])


def stack_experts(spec: ModelSpec, weights: Mapping[str, torch.Tensor], source: str) -> Mapping[str, torch.Tensor]:
    """weights with every layer's per-expert projections replaced by the stacked tensors (others untouched)."""
    if not spec.is_moe:
        return weights
    lazy = isinstance(weights, LazyWeights)
    items: Mapping[str, Any] = weights.sources() if isinstance(weights, LazyWeights) else weights
    out: dict[str, Any] = {}
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    for name, tensor in items.items():
        expert = _EXPERT.match(name)
        router = _ROUTER.match(name)
        if expert is not None:
            layer, index, proj = expert.groups()
            experts.setdefault(layer, {}).setdefault(int(index), {})[_MIXTRAL_NAMES.get(proj, proj)] = tensor
        elif router is not None:
            out[f"{router.group(1)}.mlp.gate.weight"] = tensor
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for layer, by_index in experts.items():
        _check_experts(spec, layer, by_index, source)
        ordered = [by_index[j] for j in range(spec.num_experts)]
        gate_up = StackedExperts(tuple((_source(e["gate_proj"]), _source(e["up_proj"])) for e in ordered))
        down = StackedExperts(tuple((_source(e["down_proj"]),) for e in ordered))
        out[f"{layer}.mlp.experts.gate_up_proj"] = gate_up if lazy else gate_up.read()
        out[f"{layer}.mlp.experts.down_proj"] = down if lazy else down.read()
    return LazyWeights(out) if lazy else out


def _source(tensor: Any) -> TensorSource:
    return _Tensor(tensor) if isinstance(tensor, torch.Tensor) else tensor


def _check_experts(spec: ModelSpec, layer: str, by_index: dict[int, dict[str, Any]], source: str) -> None:
    missing = [j for j in range(spec.num_experts) if j not in by_index]
    if missing or len(by_index) != spec.num_experts:
        raise ValueError(f"{source}: {layer} has experts {_span(sorted(by_index))}, the config implies "
                         f"{spec.num_experts} (0-{spec.num_experts - 1})")
    for j, projections in by_index.items():
        absent = sorted({"gate_proj", "up_proj", "down_proj"} - set(projections))
        extra = sorted(set(projections) - {"gate_proj", "up_proj", "down_proj"})
        if absent or extra:
            problem = f"lacks {', '.join(absent)}" if absent else f"has unsupported weights {', '.join(extra)}"
            raise ValueError(f"{source}: {layer} expert {j} {problem}")


def _span(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices[:8])) + (" ..." if len(indices) > 8 else "")
