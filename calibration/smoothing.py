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

Under GQA the o group exists only when asked for (``gqa_o``): the q heads sharing a KV head read
the same v channels, so o's scales must be tied across them (``SmoothGroup.tie``); v's rows are
divided by one copy. ``apply_artifact`` folds it when an artifact has it; ``kiln calibrate`` leaves
it off (AWQ measured no better with it on SmolLM2; SmoothQuant's search has no tying).
"""

from __future__ import annotations

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


def smooth_groups(spec: ModelSpec, gqa_o: bool = False) -> list[SmoothGroup]:
    groups = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        groups.append(SmoothGroup(f"{p}.self_attn.qkv", f"{p}.input_layernorm.weight",
                                  tuple(f"{p}.self_attn.{n}_proj" for n in "qkv")))
        groups.append(SmoothGroup(f"{p}.mlp.gate_up", f"{p}.{mlp_norm_name(spec)}.weight",
                                  (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")))
        groups.append(SmoothGroup(f"{p}.mlp.down", f"{p}.mlp.up_proj.weight", (f"{p}.mlp.down_proj",)))
        if spec.num_heads == spec.num_kv_heads:
            groups.append(SmoothGroup(f"{p}.self_attn.o", f"{p}.self_attn.v_proj.weight", (f"{p}.self_attn.o_proj",)))
        elif gqa_o:
            groups.append(SmoothGroup(f"{p}.self_attn.o", f"{p}.self_attn.v_proj.weight", (f"{p}.self_attn.o_proj",),
                                      spec.num_heads // spec.num_kv_heads, spec.head_dim))
    return groups


def fold(weights: dict[str, torch.Tensor], groups: list[SmoothGroup],
         scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A new weight dict with every group's scales folded in (groups without scales are skipped)."""
    out = dict(weights)
    for group in groups:
        s = scales.get(group.name)
        if s is None:
            continue
        s = s.to(torch.float32)
        sp = group.prev_scales(s)
        prev = out[group.prev]
        if prev.ndim == 1:
            out[group.prev] = prev / sp
        else:
            out[group.prev] = prev / sp[:, None]
            bias = group.prev[: -len("weight")] + "bias"
            if bias in out:
                out[bias] = out[bias] / sp
        for lin in group.linears:
            out[f"{lin}.weight"] = out[f"{lin}.weight"] * s[None, :]
    return out
