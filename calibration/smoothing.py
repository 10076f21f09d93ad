"""Per-input-channel smoothing scales and their exact folding into the weights.

A smoothing group is a set of linears that read the same activation x, plus the parameter
that produces x: dividing that parameter by s (channel-wise) and multiplying the linears'
input columns by s leaves the model's function unchanged, ``(x / s) @ (W * s)^T == x @ W^T``,
while moving activation range into the weights (SmoothQuant) or weight precision onto the
salient channels (AWQ).

Groups per decoder layer (the LM head and the tied embedding are never touched):
  self_attn.qkv   input_layernorm.weight          -> q_proj, k_proj, v_proj
  mlp.gate_up     post_attention_layernorm.weight -> gate_proj, up_proj
  mlp.down        up_proj rows                    -> down_proj   (down's input is silu(gate) * up)
  self_attn.o     v_proj rows (+ bias)            -> o_proj      (only without GQA: o's input
                                                                  channel h*D+d comes from v's)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.spec import ModelSpec


@dataclass(frozen=True)
class SmoothGroup:
    name: str  # the key of its scales in a calibration artifact
    prev: str  # parameter divided by s: a norm weight [K] or a linear weight's rows [K, in]
    linears: tuple[str, ...]  # modules whose weight columns are multiplied by s

    @property
    def prev_is_norm(self) -> bool:
        return self.prev.endswith("layernorm.weight")


def smooth_groups(spec: ModelSpec) -> list[SmoothGroup]:
    groups = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        groups.append(SmoothGroup(f"{p}.self_attn.qkv", f"{p}.input_layernorm.weight",
                                  tuple(f"{p}.self_attn.{n}_proj" for n in "qkv")))
        groups.append(SmoothGroup(f"{p}.mlp.gate_up", f"{p}.post_attention_layernorm.weight",
                                  (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")))
        groups.append(SmoothGroup(f"{p}.mlp.down", f"{p}.mlp.up_proj.weight", (f"{p}.mlp.down_proj",)))
        if spec.num_heads == spec.num_kv_heads:
            groups.append(SmoothGroup(f"{p}.self_attn.o", f"{p}.self_attn.v_proj.weight", (f"{p}.self_attn.o_proj",)))
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
        prev = out[group.prev]
        if prev.ndim == 1:
            out[group.prev] = prev / s
        else:
            out[group.prev] = prev / s[:, None]
            bias = group.prev[: -len("weight")] + "bias"
            if bias in out:
                out[bias] = out[bias] / s
        for lin in group.linears:
            out[f"{lin}.weight"] = out[f"{lin}.weight"] * s[None, :]
    return out
