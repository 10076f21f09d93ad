"""Norm tuning: after AWQ, train the RMSNorm gains of the int4-simulated model to match fp32.

AWQ chooses scales and clips one linear at a time, on sampled rows; what it cannot see is how
the rounding errors of every linear add up along the residual stream. Norm tuning (after Li et
al., "Norm Tweaking", AAAI 2024) trains only the RMSNorm weights of the quantized model, end to
end, on KL(fp32 model || int4-simulated model) over the calibration windows:

- the weights stay exactly what the build's int4 pass will quantize (AWQ-scaled, clipped, RTN
  group-wise; the LM head int8 per channel), so the tuned gains fit the engine's rounding;
- the target is the fp32 model's next-token distribution, not the text: tuning pulls the
  quantized model towards fp32, not towards the calibration corpus;
- the result is one gain per norm channel, folded into the norm weights at build time: the
  engine gets no new op and no new byte.

Costs one forward+backward of the model per calibration window and epoch (SmolLM2-135M, 16 x 512
tokens, 2 epochs: ~2 min on 2 cores) and keeps the fp32 model's log-probabilities of the
calibration windows in bfloat16 (windows x tokens x vocab x 2 bytes: 0.8 GB for SmolLM2).
Measured on SmolLM2-135M int4 g128 (`kiln eval`, 16 Persuasion windows): AWQ 49.39 -> 46.73
perplexity (fp32 44.08), half the gap; on a text outside the calibration domain (the GPL-3
licence, 14 windows) 28.52 -> 27.14 (fp32 22.97), a quarter of the gap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from kiln.export.progress import track
from kiln.export.reference import soft_cap

from .collect import run_layers
from .fake_quant import int4_groupwise, int8_per_channel

GAIN_PREFIX = "norm_gain."
EPOCHS = 2
LEARNING_RATE = 1e-2  # Adam on gains that start at 1 (~1% per step, cosine-decayed to 0); chosen by the
# calibration KL on SmolLM2 int4 g128: 0.0894 at 5e-3, 0.0834 at 1e-2, 0.0939 at 2e-2 (0.1547 untuned)


def norm_names(spec) -> list[str]:
    """Every RMSNorm of the decoder: two per layer (four with Gemma's sandwich norms) and the final one."""
    kinds = ("input_layernorm", "post_attention_layernorm")
    if spec.sandwich_norms:
        kinds += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    names = [f"model.layers.{i}.{kind}" for i in range(spec.num_layers) for kind in kinds]
    return names + ["model.norm"]


def int4_simulated(weights: dict[str, torch.Tensor], group_size: int,
                   int8: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The weights as the build's int4 pass will dequantize them: every decoder linear int4 RTN, but
    the modules named in int8 (the artifact's int8 fallback) int8 per channel."""
    out = dict(weights)
    for name, w in weights.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            module = name[: -len(".weight")]
            out[name] = int8_per_channel(w.float()) if module in int8 else int4_groupwise(w.float(), group_size)
    return out


class _Gain(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(size))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.gain


def _log_probs(model, head: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax of the logits [T, vocab] of one window, through `head` (the model's own LM head
    or its int8 copy)."""
    x = run_layers(model, ids[None], torch.arange(ids.numel())[None])
    logits = soft_cap(F.linear(model.model.norm(x)[0], head), model.spec.final_logit_softcap)
    return torch.log_softmax(logits, dim=-1)


def _kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), both log-probabilities [T, vocab]."""
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def tune_norms(spec, fp32_weights: dict[str, torch.Tensor], student_weights: dict[str, torch.Tensor],
               windows: list[torch.Tensor],
               progress: Callable[[str], None] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Gains {norm name: [hidden]} for the norms of `student_weights` (the AWQ-scaled, clipped weights as
    the build will dequantize them: int4_simulated), and a report {kl_before, kl_after, epochs, seconds}."""
    from kiln.export.checkpoint_types import lm_head_weight_name
    from kiln.export.reference import ReferenceModel

    say = progress or (lambda _m: None)
    start = time.perf_counter()
    head_name = lm_head_weight_name(spec)
    teacher = ReferenceModel(spec, fp32_weights)
    with torch.no_grad():
        targets = [_log_probs(teacher, fp32_weights[head_name].float(), ids).to(torch.bfloat16) for ids in windows]
    del teacher
    student = ReferenceModel(spec, student_weights)
    head = int8_per_channel(student_weights[head_name].float())
    gains = {}
    for name in norm_names(spec):
        norm = student.get_submodule(name)
        gains[name] = _Gain(norm.weight.shape[0])
        parametrize.register_parametrization(norm, "weight", gains[name])
    params = [g.gain for g in gains.values()]
    epochs, lr = EPOCHS, LEARNING_RATE
    optimizer = torch.optim.Adam(params, lr=lr)

    def mean_kl() -> float:
        with torch.no_grad():
            pairs = zip(targets, windows, strict=True)
            return sum(float(_kl(t.float(), _log_probs(student, head, ids))) for t, ids in pairs) / len(windows)

    kl_before = mean_kl()
    say(f"norm tuning: KL(fp32 || int4) {kl_before:.4f} before, {len(params)} norms, {epochs} epochs")
    total, step = epochs * len(windows), 0
    order = torch.Generator().manual_seed(0)
    for epoch in range(epochs):
        order_ids = torch.randperm(len(windows), generator=order).tolist()
        for i in track(order_ids, f"norm tuning epoch {epoch + 1}/{epochs}", "window"):
            for group in optimizer.param_groups:  # cosine decay to 0 over all steps
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            loss = _kl(targets[i].float(), _log_probs(student, head, windows[i]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
        say(f"norm tuning: epoch {epoch + 1}/{epochs} done in {time.perf_counter() - start:.1f}s")
    kl_after = mean_kl()
    say(f"norm tuning: KL(fp32 || int4) {kl_before:.4f} -> {kl_after:.4f} in {time.perf_counter() - start:.1f}s")
    report = {"kl_before": kl_before, "kl_after": kl_after, "epochs": epochs, "learning_rate": lr,
              "seconds": round(time.perf_counter() - start, 1)}
    return {name: g.gain.detach().clone() for name, g in gains.items()}, report


def apply_gains(weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Multiply each norm weight by its tuned gain (``norm_gain.<norm>`` entries of an artifact)."""
    out = dict(weights)
    for key, gain in scales.items():
        if key.startswith(GAIN_PREFIX):
            name = f"{key[len(GAIN_PREFIX):]}.weight"
            if name not in out or out[name].shape != gain.shape:
                raise KeyError(f"{name} with shape {tuple(gain.shape)}")
            out[name] = out[name] * gain.to(out[name].dtype)
    return out
