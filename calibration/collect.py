"""Run the PyTorch reference model on calibration text and record what the linear layers see.

For every nn.Linear inside the decoder layers: per-input-channel abs-max (SmoothQuant) and
mean |x| (AWQ), plus a fixed subsample of input rows (the scale searches of both methods), and on
request the input Hessian sum x x^T over every token (GPTQ rounding; linears reading the same input,
q/k/v or gate/up, share one).
For every mixture-of-experts layer: the router's input, recorded as a linear's (it is the experts' input), and
each routed expert's down-projection input mean |x| over the tokens routed to it (kiln.MoE's experts are inside
one op, not nn.Linear modules; AWQ, calibration/moe_awq.py).
For every layer's KV: a per-KV-head bound on |K| after RoPE (the max over each rotary pair's
norm, which RoPE preserves, so the bound holds at every position) and on |V| (KV int8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.errors import InvalidParamError
from kiln.export.moe import expert_activations
from kiln.export.progress import track

Progress = Callable[[str], None]


@dataclass
class LinearStats:
    absmax: torch.Tensor  # [K]
    abs_sum: torch.Tensor  # [K] float64
    count: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)  # rows [n, K]
    hessian: torch.Tensor | None = None  # [K, K] sum of x x^T (collect(hessians=True)); may be another linear's
    hessian_owner: str = ""  # the linear whose input (and Hessian object) this one shares; "" = its own

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).float()

    def sample_rows(self) -> torch.Tensor:
        return torch.cat(self.samples) if self.samples else torch.empty(0, self.absmax.numel())


@dataclass
class ExpertStats:
    """What a MoE layer's routed experts' down projections read: per expert, the sum of |x| and the token count."""

    abs_sum: torch.Tensor  # [E, F] float64
    count: torch.Tensor  # [E] int64

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / self.count.clamp_min(1)[:, None]).float()


@dataclass(frozen=True)
class ActivationStats:
    linears: dict[str, LinearStats]  # module name, e.g. "model.layers.0.self_attn.q_proj"
    k_absmax: torch.Tensor  # [num_layers, Hkv]
    v_absmax: torch.Tensor  # [num_layers, Hkv]
    num_tokens: int
    experts: dict[str, ExpertStats] = field(default_factory=dict)  # "model.layers.0.mlp.experts"


def routed_rows(rows: torch.Tensor, router: torch.Tensor, top_k: int) -> list[torch.Tensor]:
    """Per expert, the indices of the rows [T, D] kiln.MoE routes to it (its top_k router logits)."""
    chosen = torch.topk(rows @ router.T, top_k, dim=-1).indices
    return [torch.nonzero((chosen == e).any(-1)).flatten() for e in range(router.shape[0])]



def token_windows(token_ids: list[int], window: int, count: int) -> list[torch.Tensor]:
    """The first `count` consecutive, non-overlapping windows of `window` tokens."""
    n = min(count, len(token_ids) // window)
    if n == 0:
        raise InvalidParamError(f"calibration text has {len(token_ids)} tokens, fewer than one window of {window}",
                                "window")
    return [torch.tensor(token_ids[i * window:(i + 1) * window], dtype=torch.int64) for i in range(n)]


@torch.no_grad()
def collect(model: nn.Module, windows: list[torch.Tensor], rows_per_window: int = 64,
            progress: Progress | None = None, hessians: bool = False) -> ActivationStats:
    """Run each window (one sequence, positions 0..W-1) through model, gathering statistics (and the
    input Hessians when asked: [K, K] float32 per distinct input, 0.4 GB for SmolLM2-135M)."""
    say = progress or (lambda _m: None)
    spec = model.spec
    stats: dict[str, LinearStats] = {}
    k_max = torch.zeros(spec.num_layers, spec.num_kv_heads)
    v_max = torch.zeros(spec.num_layers, spec.num_kv_heads)
    gen = torch.Generator().manual_seed(0)
    hooks = []
    last_input: list = [None, ""]  # the input tensor the last hooked linear read, and that linear

    def linear_hook(name):
        def hook(_module, args, _out):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            s = stats.get(name)
            if s is None:
                s = stats[name] = LinearStats(torch.zeros(x.shape[1]), torch.zeros(x.shape[1], dtype=torch.float64))
            a = x.abs()
            torch.maximum(s.absmax, a.amax(0), out=s.absmax)
            s.abs_sum += a.sum(0, dtype=torch.float64)
            s.count += x.shape[0]
            if rows_per_window:
                idx = torch.randperm(x.shape[0], generator=gen)[:rows_per_window]
                s.samples.append(x[idx].clone())
            if hessians:
                accumulate_hessian(name, s, args[0], x)
        return hook

    def accumulate_hessian(name, s, raw, x):
        # the same tensor object as the previous linear's input (held alive by last_input, so not a reused
        # address): q/k/v after the first, up after gate. Decided once, on the first window.
        if s.hessian is None:
            if raw is last_input[0]:
                s.hessian_owner = last_input[1]
                s.hessian = stats[s.hessian_owner].hessian
            else:
                s.hessian = torch.zeros(x.shape[1], x.shape[1])
        last_input[0], last_input[1] = raw, s.hessian_owner or name
        if not s.hessian_owner:
            s.hessian.addmm_(x.T, x)

    from kiln.export.reference import rope_attention_factor

    rotated, half = spec.rotated_dims, spec.rotated_dims // 2
    # partial rotary carries LongRoPE's attention factor on cos/sin, hence on the cached rotated dims
    rotated_gain = rope_attention_factor(spec) if rotated < spec.head_dim else 1.0

    def kv_hook(layer, is_key):
        def hook(_module, _args, out):
            h = out.reshape(-1, spec.num_kv_heads, spec.head_dim).float()
            if is_key:  # RoPE rotates (d, d + R/2) pairs: their norm bounds |K| at any position; dims >= R pass
                pairs = torch.sqrt(h[..., :half] ** 2 + h[..., half:rotated] ** 2) * rotated_gain
                h = torch.cat((pairs, h[..., rotated:].abs()), dim=-1)
                torch.maximum(k_max[layer], h.abs().amax((0, 2)), out=k_max[layer])
            else:
                torch.maximum(v_max[layer], h.abs().amax((0, 2)), out=v_max[layer])
        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in name:
            hooks.append(module.register_forward_hook(linear_hook(name)))

    def experts_hook(name, top_k, router_hook):
        def hook(module, args, out):
            router_hook(module, args, out)  # the router is a weight kiln::moe reads, not a module call: its input
            rows = args[0].reshape(-1, args[0].shape[-1]).float()
            gate_up = module.experts.gate_up_proj
            s = experts.get(name)
            if s is None:
                s = experts[name] = ExpertStats(torch.zeros(gate_up.shape[0], gate_up.shape[1] // 2,
                                                            dtype=torch.float64),
                                                torch.zeros(gate_up.shape[0], dtype=torch.int64))
            for e, idx in enumerate(routed_rows(rows, module.gate.weight, top_k)):
                if idx.numel():
                    s.abs_sum[e] += expert_activations(rows[idx], gate_up[e]).abs().sum(0, dtype=torch.float64)
                    s.count[e] += idx.numel()
        return hook

    experts: dict[str, ExpertStats] = {}
    for i, layer in enumerate(model.model.layers):
        if spec.is_moe:
            prefix = f"model.layers.{i}.mlp"
            hooks.append(layer.mlp.register_forward_hook(experts_hook(f"{prefix}.experts", spec.experts_per_token,
                                                                      linear_hook(f"{prefix}.gate"))))
        # the cached K is the k_norm output where the model normalises k per head (Qwen3)
        key_module = layer.self_attn.k_norm if spec.qk_norm else layer.self_attn.k_proj
        hooks.append(key_module.register_forward_hook(kv_hook(i, True)))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(kv_hook(i, False)))
    try:
        tokens = 0
        for i, ids in enumerate(track(windows, "calibration windows", "window")):
            run_layers(model, ids[None], torch.arange(ids.numel(), dtype=torch.int64)[None])
            tokens += ids.numel()
            say(f"calibration window {i + 1}/{len(windows)} ({tokens} tokens)")
    finally:
        for h in hooks:
            h.remove()
        last_input[0] = None
    return ActivationStats(stats, k_max, v_max, tokens, experts)


def run_layers(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """ReferenceModel.forward without the final norm and LM head (half the FLOPs of a small model):
    the residual stream after the last layer."""
    return model.run_layers(model.embed(input_ids), position_ids)
