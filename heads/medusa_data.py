"""Self-distillation data for Medusa heads: the fp32 reference model's own greedy continuations.

``greedy_states`` runs a batch of equal-length prompts through ReferenceModel's weights with a KV cache
(the reference itself recomputes the whole prefix per token) and returns, for every generated token,
the residual stream (before the final norm) of the position that predicted it. Row j of a sequence
predicts token j with the LM head and token j + i with head i, so the heads train and are scored on
exactly what greedy verification would compare their guesses with.

The prompts: windows of the calibration book, continued as plain text, and paragraphs of it wrapped in
the chat template with a request ("Summarise ...", "What happens next ..."), so the heads also see the
model's chat register; held out: windows never trained on, and CHAT_QUESTIONS, open questions unrelated
to the book (what `kiln serve` mostly answers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.export.reference import ReferenceModel, apply_rope

Progress = Callable[[str], None]

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Explain in two sentences what a noun is.",
    "Write a short sentence about the sea.",
    "How do plants make their food?",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "How does a bicycle stay upright?",
    "What are the main causes of the First World War?",
    "Suggest a name for a small bakery.",
    "Explain what a computer program is to a child.",
    "What should I pack for a weekend hiking trip?",
    "Describe the water cycle.",
    "What is a healthy breakfast?",
    "How do I make a cup of tea?",
    "What is photosynthesis?",
    "Tell me a fun fact about octopuses.",
    "Why do we have seasons?",
    "What is the Pythagorean theorem?",
    "Write a short thank-you note to a teacher.",
    "How can I learn a new language quickly?",
    "What does a doctor do?",
)

# Requests that wrap a calibration paragraph into a chat turn (training prompts only).
CHAT_REQUESTS = (
    "Summarise this passage in a few sentences:\n\n{}",
    "What happens next? Continue the story:\n\n{}",
    "Explain what this passage says about the characters:\n\n{}",
    "Rewrite this passage in modern English:\n\n{}",
)


@dataclass(frozen=True)
class Continuations:
    """Greedy continuations of a batch of prompts: states[b, j] predicted tokens[b, j]."""

    states: torch.Tensor  # float32 [B, N, D], residual stream before the final norm
    tokens: torch.Tensor  # int64 [B, N]
    lengths: torch.Tensor  # int64 [B]: rows before (and including) the first end-of-sequence token

    def valid(self) -> torch.Tensor:
        """bool [B, N]: row j is part of the continuation (not after its end)."""
        return torch.arange(self.tokens.shape[1])[None] < self.lengths[:, None]


class _Cache:
    """Per-layer K/V of a batch, preallocated for all positions the generation will reach."""

    def __init__(self, model: ReferenceModel, batch: int, positions: int) -> None:
        spec = model.spec
        shape = (batch, spec.num_kv_heads, positions, spec.head_dim)
        self.k = [torch.zeros(shape) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape) for _ in range(spec.num_layers)]


def _forward(model: ReferenceModel, ids: torch.Tensor, start: int, cache: _Cache, pad: torch.Tensor) -> torch.Tensor:
    """The residual stream [B, S, D] after the last layer for tokens ids [B, S] in cache slots start..,
    attending to the cached slots before them (the same arithmetic as ReferenceModel.forward). Row b is
    left-padded by pad[b] slots: slot s holds position s - pad[b]; padding is visible to itself only,
    so its (unused) rows stay finite and no real token sees it."""
    spec = model.spec
    batch, steps = ids.shape
    end = start + steps
    slots = torch.arange(end)
    key_pos = slots[None] - pad[:, None]  # [B, end]
    q_pos = key_pos[:, start:end]  # [B, S]
    cos, sin = model.rope_cos_sin(q_pos.clamp(min=0))
    visible = (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_pos[:, None, :] >= 0)
    if spec.sliding_window:
        visible &= q_pos[:, :, None] - key_pos[:, None, :] < spec.sliding_window
    visible |= slots[None, None, :] == torch.arange(start, end)[None, :, None]  # padding sees itself
    visible = visible[:, None]  # [B, 1, S, end]
    x = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).reshape(batch, steps, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).reshape(batch, steps, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).reshape(batch, steps, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cache.k[i][:, :, start:end] = apply_rope(k, cos, sin)
        cache.v[i][:, :, start:end] = v
        out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), cache.k[i][:, :, :end], cache.v[i][:, :, :end],
                                             attn_mask=visible, scale=attn.scale,
                                             enable_gqa=attn.num_heads != attn.num_kv_heads)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


def lm_head_weight(model: ReferenceModel) -> torch.Tensor:
    """[V, D]: the LM head's weight (the embedding table when tied)."""
    return model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight


@torch.no_grad()
def greedy_states(model: ReferenceModel, prompts: list[list[int]], new_tokens: int) -> Continuations:
    """Greedy-decode new_tokens after each prompt (any lengths), keeping the predicting states."""
    spec = model.spec
    if spec.qk_norm or spec.sandwich_norms or spec.layer_types or spec.attn_logit_softcap:
        raise ValueError(f"draft-head training decodes Llama-shaped blocks; {spec.family}'s (q/k norms, Gemma's "
                         "norms, per-layer windows or soft-caps) are not implemented in its cached decoder")
    batch = len(prompts)
    prompt_len = max(len(p) for p in prompts)
    pad = torch.tensor([prompt_len - len(p) for p in prompts])
    ids = torch.zeros(batch, prompt_len, dtype=torch.int64)
    for b, prompt in enumerate(prompts):
        ids[b, prompt_len - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
    cache = _Cache(model, batch, prompt_len + new_tokens)
    head = lm_head_weight(model)
    states = torch.empty(batch, new_tokens, model.spec.hidden_size)
    tokens = torch.empty(batch, new_tokens, dtype=torch.int64)
    x = _forward(model, ids, 0, cache, pad)[:, -1:]
    for j in range(new_tokens):
        states[:, j] = x[:, 0]
        tokens[:, j] = F.linear(model.model.norm(x[:, 0]), head).argmax(-1)
        if j + 1 < new_tokens:
            x = _forward(model, tokens[:, j:j + 1], prompt_len + j, cache, pad)
    eos = torch.zeros_like(tokens, dtype=torch.bool)
    for token in model.spec.eos_token_ids:
        eos |= tokens == token
    # the end-of-sequence token is a label too; nothing after it is
    first = torch.where(eos.any(1), eos.int().argmax(1) + 1, torch.full((batch,), new_tokens))
    return Continuations(states, tokens, first)


def render_chat(tokenizer_config: dict, user_message: str) -> str:
    """The user turn in the checkpoint's chat template, ready for the assistant's answer."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = tokenizer_config.get("chat_template")
    if not template:
        raise ValueError("the checkpoint's tokenizer has no chat template")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)

    def token(key: str) -> str:
        value = tokenizer_config.get(key)
        return (value.get("content") if isinstance(value, dict) else value) or ""

    return env.from_string(template).render(messages=[{"role": "user", "content": user_message}],
                                            add_generation_prompt=True, bos_token=token("bos_token"),
                                            eos_token=token("eos_token"))
