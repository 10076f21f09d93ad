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
rotary (Phi-4: RoPE on the first ``rotary_dim`` dims, the rest passed through), and LongRoPE's and YaRN's
attention factor (transformers scales cos and sin by it; with full rotary q.k then scales by its square, which
kiln folds into the attention scale so that RoPE keeps the form the op absorbs; with partial rotary only the
rotated dims scale, so cos and sin carry it as in transformers).

Gemma 2 / 3 (ModelSpec.sandwich_norms and the fields after it): the embedding times sqrt(hidden); four norms
per block, each a plain RMSNorm because the loaders fold Gemma's ``1 + w`` into the weight; GeGLU (gelu-tanh
gate); the attention scale query_pre_attn_scalar^-1/2; the attention scores soft-capped
``cap * tanh(scores / cap)`` before the mask (Gemma 2), as transformers' eager attention computes it; per-layer
sliding windows (``layer_types``), with Gemma 3's sliding layers rotated at their own base; the final logits
soft-capped. Each layer gets its own mask and cos/sin from ``ReferenceModel.layer_inputs``.
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


def rope_inv_freq(spec: ModelSpec, local: bool = False) -> torch.Tensor:
    """RoPE inverse frequencies [rotated_dims // 2], float32, with the spec's rope scaling applied (transformers'
    expressions and dtypes, for bit-equal frequencies); local: those of Gemma 3's sliding layers
    (rope_local_theta, unscaled)."""
    dim = spec.rotated_dims
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / ((spec.rope_local_theta if local else spec.rope_theta) ** exponents)
    scaling = spec.rope_scaling
    if scaling is None or local:
        return inv_freq
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if scaling.long_context else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.rope_theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "dynamic":
        return _dynamic_ntk_inv_freq(spec, exponents)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(spec)
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


def _dynamic_ntk_inv_freq(spec: ModelSpec, exponents: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: the base stretched for the engine's context (ModelSpec.for_context) past the original."""
    scaling = spec.rope_scaling
    assert scaling is not None
    dim, original = spec.rotated_dims, scaling.original_max_position_embeddings
    seq_len = max(scaling.context_length, original)
    base = spec.rope_theta * ((scaling.factor * seq_len / original) - (scaling.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base**exponents)


def _yarn_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """YaRN: dims that turn more than beta_fast times over the original context keep their frequency, those
    turning fewer than beta_slow times are divided by the factor, and a linear ramp blends the band between."""
    scaling = spec.rope_scaling
    assert scaling is not None
    dim, base, original = spec.rotated_dims, spec.rope_theta, scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


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
    """The factor on cos and sin: LongRoPE's and YaRN's attention factor (1.0 for every other rope)."""
    scaling = spec.rope_scaling
    return scaling.attention_factor if scaling is not None and scaling.rope_type in ("longrope", "yarn") else 1.0


def attention_scale(spec: ModelSpec) -> float:
    """The softmax scale: 1/sqrt(head_dim) (Gemma: 1/sqrt(query_pre_attn_scalar)), times the rope attention
    factor squared when RoPE rotates the whole head (see the module doc)."""
    factor = rope_attention_factor(spec) if spec.rotated_dims == spec.head_dim else 1.0
    return (spec.query_pre_attn_scalar or spec.head_dim) ** -0.5 * factor * factor


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in transformers' order of operations (0: x unchanged)."""
    return torch.tanh(x / cap) * cap if cap else x


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
        self.softcap = spec.attn_logit_softcap

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
        scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * self.scale, self.softcap)
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
        self.gelu = spec.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block; with sandwich norms (Gemma) attention and MLP outputs are normed too, and the MLP reads
    pre_feedforward_layernorm where Llama's reads post_attention_layernorm."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(spec) if spec.is_moe else MLP(spec)
        self.sandwich = spec.sandwich_norms
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not self.sandwich:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def mlp_norm_name(spec: ModelSpec) -> str:
    """The norm whose output the MLP reads (what calibration smooths the gate/up projections against)."""
    return "pre_feedforward_layernorm" if spec.sandwich_norms else "post_attention_layernorm"


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
        if spec.rope_local_theta:
            self.register_buffer("inv_freq_local", rope_inv_freq(spec, local=True), persistent=False)
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_checkpoint(cls, checkpoint) -> ReferenceModel:
        return cls(checkpoint.spec, checkpoint.weights)

    def rope_cos_sin(self, position_ids: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, S, rotated_dims] for the given absolute positions (local: Gemma 3's sliding layers)."""
        inv_freq = self.inv_freq_local if local else self.inv_freq
        freqs = position_ids.unsqueeze(-1).to(torch.float32) * inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        if self.spec.rotated_dims == self.spec.head_dim or rope_attention_factor(self.spec) == 1.0:
            return cos, sin  # (a full-rotary factor is in the attention scale)
        return cos * rope_attention_factor(self.spec), sin * rope_attention_factor(self.spec)

    def layer_inputs(self, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(cos, sin, mask) of every layer, each distinct one computed once."""
        spec = self.spec
        rope = {local: self.rope_cos_sin(position_ids, local) for local in {spec.uses_local_rope(i)
                                                                             for i in range(spec.num_layers)}}
        masks = {w: causal_mask(position_ids, w) for w in {spec.layer_window(i) for i in range(spec.num_layers)}}
        return [(*rope[spec.uses_local_rope(i)], masks[spec.layer_window(i)]) for i in range(spec.num_layers)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * self.spec.embedding_scale if self.spec.embedding_scale != 1.0 else x

    def run_layers(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The decoder layers on embeddings x [B, S, hidden]: the residual stream after the last one."""
        for layer, (cos, sin, mask) in zip(self.model.layers, self.layer_inputs(position_ids), strict=True):
            x = layer(x, cos, sin, mask)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final-normed states (and the final soft-cap)."""
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return soft_cap(F.linear(hidden, head), self.spec.final_logit_softcap)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.run_layers(self.embed(input_ids), position_ids)
        return self.logits(self.model.norm(x))
