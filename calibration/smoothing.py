"""Per-input-channel smoothing scales and their exact folding into the weights.

A smoothing group is a set of linears that read the same activation x, plus the parameter
that produces x: dividing that parameter by s (channel-wise) and multiplying the linears'
input columns by s leaves the model's function unchanged, ``(x / s) @ (W * s)^T == x @ W^T``,
while moving activation range into the weights (SmoothQuant) or weight precision onto the
salient channels (AWQ).

Groups per decoder layer (the LM head and the tied embedding are never touched):
  self_attn.qkv   input_layernorm.weight          -> q_proj, k_proj, v_proj
  mlp.gate_up     post_attention_layernorm.weight -> gate_proj, up_proj   (Gemma: pre_feedforward_layernorm)
  mlp.down        up_proj rows                    -> down_proj   (down's input is act(gate) * up)
  self_attn.o     v_proj rows (+ bias)            -> o_proj      (o's input channel h*D+d comes
                                                                  from v's channel kv(h)*D+d)

A mixture-of-experts layer's MLP (kiln.MoE, export/moe.py) has instead:
  mlp.gate_up     post_attention_layernorm.weight -> the router (mlp.gate), every expert's gate/up rows
                                                     (the stack mlp.experts.gate_up_proj [E, 2F, D]), and the
                                                     shared expert's gate/up and gate where the family has one
  mlp.experts.down  expert e's up rows / s[e]     -> expert e's down columns * s[e]: one s [E, F] (ExpertDownGroup)
  mlp.shared_expert.down  shared up_proj rows     -> shared down_proj
All experts read the same normalised input, so they share one scale there (the router is exact under it: float32);
each expert's down input is its own, so each has its own scales.

Under GQA the o group exists only when asked for (``gqa_o``): the q heads sharing a KV head read
the same v channels, so o's scales must be tied across them (``SmoothGroup.tie``); v's rows are
divided by one copy. ``apply_artifact`` folds it when an artifact has it; ``kiln calibrate`` leaves
it off (AWQ measured no better with it on SmolLM2; SmoothQuant's search has no tying).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kiln.export.reference import mlp_norm_name
from kiln.spec import ModelSpec


@dataclass(frozen=True)
class SmoothGroup:
    name: str  # the key of its scales in a calibration artifact
    prev: str  # parameter divided by s: a norm weight [K] or a linear weight's rows [K, in]
    linears: tuple[str, ...]  # modules whose weight columns are multiplied by s
    heads_per_kv: int = 1  # > 1: o_proj under GQA, s [H*D] tied across the q heads of a KV head
    head_dim: int = 0
    stacks: tuple[str, ...] = ()  # expert stacks [E, N, K] (parameter names) whose K axis is multiplied by s

    @property
    def prev_is_norm(self) -> bool:
        return self.prev.endswith("layernorm.weight")

    def tie(self, per_channel: torch.Tensor) -> torch.Tensor:
        """[H*D] per-channel values averaged over the q heads sharing a KV head (identity without GQA)."""
        if self.heads_per_kv == 1:
            return per_channel
        t = per_channel.reshape(-1, self.heads_per_kv, self.head_dim).mean(1, keepdim=True)
        return t.expand(-1, self.heads_per_kv, -1).reshape(-1)

    def prev_scales(self, s: torch.Tensor) -> torch.Tensor:
        """The scales of prev's channels: s itself, or under GQA one copy per KV head of tied s."""
        if self.heads_per_kv == 1:
            return s
        per_head = s.reshape(-1, self.heads_per_kv, self.head_dim)
        if not torch.allclose(per_head, per_head[:, :1].expand_as(per_head), rtol=1e-6, atol=0):
            raise ValueError(f"the scales of {self.name} are not tied across the q heads of each KV head")
        return per_head[:, 0].reshape(-1)

    def fold_into(self, weights: dict[str, torch.Tensor], s: torch.Tensor) -> None:
        sp = self.prev_scales(s)
        prev = weights[self.prev]
        if prev.ndim == 1:
            weights[self.prev] = prev / sp
        else:
            weights[self.prev] = prev / sp[:, None]
            bias = self.prev[: -len("weight")] + "bias"
            if bias in weights:
                weights[bias] = weights[bias] / sp
        for lin in self.linears:
            weights[f"{lin}.weight"] = weights[f"{lin}.weight"] * s[None, :]
        for stack in self.stacks:
            weights[stack] = weights[stack] * s


@dataclass(frozen=True)
class ExpertDownGroup:
    """Every routed expert's down projection, each smoothed through its own up rows: s [E, F] divides expert e's
    up rows (gate_up_proj[e, F:]) by s[e] and multiplies its down columns (down_proj[e][:, f]) by it."""

    name: str
    gate_up: str  # mlp.experts.gate_up_proj [E, 2F, D]: each expert's gate rows, then its up rows
    down: str  # mlp.experts.down_proj [E, D, F]
    router: str  # mlp.gate: which tokens each expert's down projection reads
    linears: tuple[str, ...] = ()  # no plain linear reads this group's input

    def fold_into(self, weights: dict[str, torch.Tensor], s: torch.Tensor) -> None:
        gate_up = weights[self.gate_up].clone()
        f = gate_up.shape[1] // 2
        gate_up[:, f:] /= s[:, :, None]
        weights[self.gate_up] = gate_up
        weights[self.down] = weights[self.down] * s[:, None, :]


Group = SmoothGroup | ExpertDownGroup


def smooth_groups(spec: ModelSpec, gqa_o: bool = False) -> list[Group]:
    groups: list[Group] = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        groups.append(SmoothGroup(f"{p}.self_attn.qkv", f"{p}.input_layernorm.weight",
                                  tuple(f"{p}.self_attn.{n}_proj" for n in "qkv")))
        groups += _moe_groups(spec, p) if spec.is_moe else _mlp_groups(spec, p)
        if spec.num_heads == spec.num_kv_heads:
            groups.append(SmoothGroup(f"{p}.self_attn.o", f"{p}.self_attn.v_proj.weight", (f"{p}.self_attn.o_proj",)))
        elif gqa_o:
            groups.append(SmoothGroup(f"{p}.self_attn.o", f"{p}.self_attn.v_proj.weight", (f"{p}.self_attn.o_proj",),
                                      spec.num_heads // spec.num_kv_heads, spec.head_dim))
    return groups


def _mlp_groups(spec: ModelSpec, p: str) -> list[Group]:
    return [SmoothGroup(f"{p}.mlp.gate_up", f"{p}.{mlp_norm_name(spec)}.weight",
                        (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")),
            SmoothGroup(f"{p}.mlp.down", f"{p}.mlp.up_proj.weight", (f"{p}.mlp.down_proj",))]


def _moe_groups(spec: ModelSpec, p: str) -> list[Group]:
    readers = (f"{p}.mlp.gate",)  # the router first: its input statistics are the experts' (calibration/collect.py)
    groups: list[Group] = []
    if spec.shared_expert_intermediate_size:
        readers += (f"{p}.mlp.shared_expert.gate_proj", f"{p}.mlp.shared_expert.up_proj", f"{p}.mlp.shared_expert_gate")
        groups.append(SmoothGroup(f"{p}.mlp.shared_expert.down", f"{p}.mlp.shared_expert.up_proj.weight",
                                  (f"{p}.mlp.shared_expert.down_proj",)))
    stack = f"{p}.mlp.experts.gate_up_proj"
    return [SmoothGroup(f"{p}.mlp.gate_up", f"{p}.{mlp_norm_name(spec)}.weight", readers, stacks=(stack,)),
            ExpertDownGroup(f"{p}.mlp.experts.down", stack, f"{p}.mlp.experts.down_proj", f"{p}.mlp.gate"),
            *groups]


def fold(weights: Mapping[str, torch.Tensor], groups: Sequence[Group],
         scales: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A new weight dict with every group's scales folded in (groups without scales are skipped)."""
    out = dict(weights)
    for group in groups:
        s = scales.get(group.name)
        if s is not None:
            group.fold_into(out, s.to(torch.float32))
    return out
