"""The reference PyTorch model: a small decoder-only transformer driven by ModelSpec.

It is what the exporter traces to ONNX and what calibration runs, so it is written for a
recognisable graph rather than for speed:

- parameters carry Hugging Face names (``model.layers.0.self_attn.q_proj.weight``...), so
  ONNX initializers and calibration scales are keyed like the checkpoint;
- attention is explicit ops: q/k/v projections -> reshape [B,S,H,D] -> transpose [B,H,S,D] ->
  RoPE (rotate_half, cos/sin from position_ids) -> repeat K/V heads (expand + reshape) ->
  matmul(q, k^T) * scale -> + mask -> softmax -> matmul(probs, v) -> transpose/reshape -> o_proj;
- the causal mask comes from position_ids (key j is visible to query i iff pos[j] <= pos[i],
  and pos[i] - pos[j] < sliding_window when the model has one). One row is one sequence:
  separating packed sequences is kiln.PagedAttention's job once the optimizer swaps it in;
- no data-dependent Python control flow; batch and sequence lengths stay dynamic.

A mixture-of-experts family's MLP is export/moe.py's SparseMoE, which traces to the single node kiln.MoE.

Family pieces, each a plain op sequence the optimizer leaves in the graph around the fused attention:
Qwen3's per-head q/k RMSNorm (``q_norm``/``k_norm`` over head_dim, before RoPE, as standard ops
feeding kiln.PagedAttention; OLMoE's over the whole projection, before the reshape into heads), partial
rotary (Phi-4: RoPE on the first ``rotary_dim`` dims, the rest passed through), and LongRoPE's attention
factor (transformers scales cos and sin by it; with full rotary q.k then scales by its square, which kiln
folds into the attention scale so that RoPE keeps the form the op absorbs; with partial rotary only the
rotated dims scale, so cos and sin carry it as in transformers).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.export.moe import SparseMoE
from kiln.spec import ModelSpec

# Added to the scores of masked keys; exp() of it underflows to exactly 0 in float32.
MASK_VALUE = -1e9


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies [rotated_dims // 2], float32, with llama3 / linear / longrope scaling applied."""
    dim = spec.rotated_dims
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "longrope":  # transformers' expression, for bit-equal frequencies
        factors = scaling.long_factor if scaling.long_context else scaling.short_factor
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.rope_theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by factor, short ones kept, the band between smoothed.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def causal_mask(position_ids: torch.Tensor, sliding_window: int = 0) -> torch.Tensor:
    """Additive mask [B, 1, S, S]: 0 where key j is visible to query i, MASK_VALUE elsewhere."""
    q_pos = position_ids.unsqueeze(-1)  # [B, S, 1]
    k_pos = position_ids.unsqueeze(-2)  # [B, 1, S]
    visible = k_pos <= q_pos
    if sliding_window:
        visible = visible & (q_pos - k_pos < sliding_window)
    zero = torch.zeros((), dtype=torch.float32)
    masked = torch.full((), MASK_VALUE, dtype=torch.float32)
    return torch.where(visible, zero, masked).unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of x (all of them unless the rotary is partial)."""
    dims = cos.shape[-1]
    if dims == x.shape[-1]:  # static: fixed by the spec
        return x * cos + rotate_half(x) * sin
    rotated, passed = x[..., :dims], x[..., dims:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


def rope_attention_factor(spec: ModelSpec) -> float:
    """LongRoPE's factor on cos and sin (1.0 for every other rope)."""
    scaling = spec.rope_scaling
    return scaling.attention_factor if scaling is not None and scaling.rope_type == "longrope" else 1.0


def attention_scale(spec: ModelSpec) -> float:
    """The softmax scale: 1/sqrt(head_dim), times the rope attention factor squared when RoPE rotates the whole
    head (see the module doc)."""
    factor = rope_attention_factor(spec) if spec.rotated_dims == spec.head_dim else 1.0
    return spec.head_dim**-0.5 * factor * factor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = attention_scale(spec)
        bias = spec.attention_bias
        self.q_proj = nn.Linear(spec.hidden_size, spec.q_size, bias=bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.kv_size, bias=bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.kv_size, bias=bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=False)
        # Qwen3: RMSNorm over each head's head_dim values; OLMoE: over the whole q / k projection. Both before RoPE.
        self.qk_norm = spec.qk_norm
        self.qk_norm_per_head = spec.qk_norm_span == "head"
        if spec.qk_norm:
            per_head = self.qk_norm_per_head
            self.q_norm = RMSNorm(spec.head_dim if per_head else spec.q_size, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim if per_head else spec.kv_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm and not self.qk_norm_per_head:  # static: fixed by the spec
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(batch, -1, self.num_heads, self.head_dim)
        k = k.reshape(batch, -1, self.num_kv_heads, self.head_dim)
        if self.qk_norm and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).reshape(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k = self._repeat_kv(k)
        v = self._repeat_kv(v)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)  # [B, H, S, D]
        out = out.transpose(1, 2).reshape(batch, -1, self.num_heads * self.head_dim)
        return self.o_proj(out)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, S, D] -> [B, H, S, D], each KV head serving H / Hkv query heads (HF repeat_kv)."""
        n_rep = self.num_heads // self.num_kv_heads
        if n_rep == 1:  # static: fixed by the spec
            return x
        batch = x.shape[0]
        x = x[:, :, None, :, :].expand(-1, -1, n_rep, -1, -1)
        return x.reshape(batch, self.num_heads, -1, self.head_dim)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(spec) if spec.is_moe else MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class ReferenceModel(nn.Module):
    """Full causal attention, no KV cache: forward(input_ids, position_ids) -> logits [B, S, vocab]."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        with torch.device("meta"):
            self.model = Decoder(spec)
            self.lm_head = (
                None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
            )
        # assign=True shares the checkpoint's tensors instead of copying them.
        self.load_state_dict(weights, strict=True, assign=True)
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_checkpoint(cls, checkpoint) -> ReferenceModel:
        return cls(checkpoint.spec, checkpoint.weights)

    def rope_cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, S, rotated_dims] for the given absolute positions."""
        freqs = position_ids.unsqueeze(-1).to(torch.float32) * self.inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        if self.spec.rotated_dims == self.spec.head_dim or rope_attention_factor(self.spec) == 1.0:
            return cos, sin  # (a full-rotary factor is in the attention scale)
        return cos * rope_attention_factor(self.spec), sin * rope_attention_factor(self.spec)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(position_ids)
        mask = causal_mask(position_ids, self.spec.sliding_window)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)
