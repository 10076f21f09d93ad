"""Per-expert checkpoint weights, stacked into the [E, ...] tensors kiln.MoE reads (export/moe.py).

Hugging Face checkpoints of every MoE family keep one Linear per expert and projection:
``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`` (Qwen2/3-MoE, OLMoE) or
``block_sparse_moe.experts.{j}.w1/w3/w2.weight`` with the router at ``block_sparse_moe.gate`` (Mixtral). They become
``mlp.gate.weight`` [E, D], ``mlp.experts.gate_up_proj`` [E, 2F, D] (each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` [E, D, F]. Lazy weights stay lazy: a stacked tensor reads its experts' tensors when the
build asks for it, one layer's experts at a time. Checkpoints already stacked (transformers >= 5's own layout) pass
through, and so do GGUF files' stacked projections (``mlp.experts.gate_proj.weight`` [E, F, D] ..., the gate and
up stacks joined row-wise per expert).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.spec import ModelSpec

from .checkpoint_types import LazyWeights, TensorSource
from .tensor_files import FileBlocks, file_blocks

_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
# GGUF files keep each projection stacked over the experts already (ffn_gate_exps ...: export/gguf_architectures.py)
_STACKED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight$")


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
class _Row:
    """A vector [D] as the one-row matrix [1, D]."""

    vector: TensorSource

    @property
    def shape(self) -> tuple[int, ...]:
        return (1, *tuple(self.vector.shape))

    def read(self) -> torch.Tensor:
        return self.vector.read().reshape(1, -1)


@dataclass(frozen=True)
class ConcatRows:
    """[E, rows_a + rows_b, cols]: two expert stacks' rows side by side per expert (gate then up); read on demand."""

    first: TensorSource
    second: TensorSource

    @property
    def shape(self) -> tuple[int, ...]:
        e, rows, cols = self.first.shape
        return (e, rows + self.second.shape[1], cols)

    def read(self) -> torch.Tensor:
        return torch.cat([self.first.read().to(torch.float32), self.second.read().to(torch.float32)], dim=1)

    def file_blocks(self) -> tuple[FileBlocks, FileBlocks] | None:
        """The two stacks' file blocks (gate's, then up's; each its E * rows rows), when both have them."""
        first, second = file_blocks(self.first), file_blocks(self.second)
        return (first, second) if first is not None and second is not None else None


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
    stacked: dict[str, dict[str, Any]] = {}
    for name, tensor in items.items():
        expert = _EXPERT.match(name)
        router = _ROUTER.match(name)
        whole = _STACKED.match(name)
        if whole is not None:
            stacked.setdefault(whole.group(1), {})[whole.group(2)] = tensor
        elif expert is not None:
            layer, index, proj = expert.groups()
            experts.setdefault(layer, {}).setdefault(int(index), {})[_MIXTRAL_NAMES.get(proj, proj)] = tensor
        elif router is not None:
            out[f"{router.group(1)}.mlp.gate.weight"] = tensor
        elif name.endswith(".mlp.shared_expert_gate.weight") and len(tensor.shape) == 1:
            row = _Row(_source(tensor))  # GGUF may keep the [1, D] gate as [D]
            out[name] = row if lazy else row.read()
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for layer, by_index in experts.items():
        _check_experts(spec, layer, by_index, source)
        ordered = [by_index[j] for j in range(spec.num_experts)]
        gate_up = StackedExperts(tuple((_source(e["gate_proj"]), _source(e["up_proj"])) for e in ordered))
        down = StackedExperts(tuple((_source(e["down_proj"]),) for e in ordered))
        out[f"{layer}.mlp.experts.gate_up_proj"] = gate_up if lazy else gate_up.read()
        out[f"{layer}.mlp.experts.down_proj"] = down if lazy else down.read()
    for layer, projections in stacked.items():
        absent = sorted({"gate_proj", "up_proj", "down_proj"} - set(projections))
        if absent:
            raise ValueError(f"{source}: {layer} has stacked experts without {', '.join(absent)}")
        gate_up_rows = ConcatRows(_source(projections["gate_proj"]), _source(projections["up_proj"]))
        out[f"{layer}.mlp.experts.gate_up_proj"] = gate_up_rows if lazy else gate_up_rows.read()
        out[f"{layer}.mlp.experts.down_proj"] = projections["down_proj"]
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
