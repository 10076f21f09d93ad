"""Shared test helpers: tiny random Hugging Face checkpoints for every supported family.

    path = make_tiny_hf_model(tmp_path, family="llama", num_key_value_heads=1)

writes a 2-layer model (config.json + model.safetensors) and a small byte-level tokenizer
(tokenizer.json + tokenizer_config.json with a ChatML template) into ``tmp_path / family``,
and returns that directory. Keyword overrides go to the transformers config class
(``hidden_size``, ``num_key_value_heads``, ``tie_word_embeddings``, ``rope_scaling``,
``sliding_window``, ...); ``seed`` picks the random weights.

``tiny_gguf.make_tiny_gguf(tmp_path, family, **overrides)`` converts such a model to an F32 GGUF the way
llama.cpp's converter does.

Weights are drawn at a scale that gives O(1) logits, so numeric comparisons are meaningful
(the transformers default init of std 0.02 makes every logit nearly zero).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

# Special tokens of the tiny tokenizer, at the same ids as SmolLM2's.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_BOS_ID = 1
TINY_EOS_ID = 2
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_MERGES = (("\u0120", "t"), ("h", "e"))

_TINY_DEFAULTS = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,  # kiln build's default context (a shorter model caps it)
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=TINY_BOS_ID,
    eos_token_id=TINY_EOS_ID,
    pad_token_id=None,
)

# LongRoPE factor sets for the tiny Phi models: one per rotary frequency, short near 1 (as Phi-3.5's
# 1.0-1.1), long growing to 18 over the low frequencies (as its 1.0-60): far enough apart that using the
# wrong set moves the logits by O(1).
def _longrope_factors(pairs: int) -> dict[str, list[float]]:
    return {"short_factor": [1.0 + 0.02 * i for i in range(pairs)],
            "long_factor": [1.0 + 17.0 * (i / (pairs - 1)) ** 2 for i in range(pairs)]}


# Each family: its transformers config class, the architecture config.json names, and the keys of a real
# config.json of that family (values as the real model has them unless shrunk: layers, width, heads, vocab,
# contexts). Qwen3-0.6B: head_dim 128 with hidden 1024 / 16 heads (head_dim is not hidden / heads). Phi-3.5-mini:
# MHA, untied, LongRoPE over a 4k original context. Phi-4-mini: GQA, tied, partial rotary 0.75 with LongRoPE.
_FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=32, attention_bias=False, attention_dropout=0.0, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, sliding_window=None, use_sliding_window=False,
        max_window_layers=2, initializer_range=0.02,
    )),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=4, tie_word_embeddings=False, hidden_act="silu", attention_dropout=0.0,
        embd_pdrop=0.0, resid_pdrop=0.0, rope_theta=10000.0, max_position_embeddings=128,
        original_max_position_embeddings=32, sliding_window=262144,
        rope_scaling={"type": "longrope", **_longrope_factors(8)},
    )),
    "phi4": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=True, hidden_act="silu", attention_dropout=0.0,
        embd_pdrop=0.0, resid_pdrop=0.0, rope_theta=10000.0, max_position_embeddings=128,
        original_max_position_embeddings=32, sliding_window=262144, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", **_longrope_factors(6)},
    )),
    # Gemma-2-2B: head_dim 256, attention and final soft-caps, every other layer sliding (window 4096 -> 8).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=4, head_dim=256, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=8, rope_theta=10000.0,
        rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
    )),
    # Gemma-3-1B (text): MQA, q/k norms, five sliding layers (window 512 -> 8) to one global, local RoPE base.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh", sliding_window=8, sliding_window_pattern=6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=None, attn_logit_softcapping=None, final_logit_softcapping=None,
        rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
    )),
    # Gemma-3-4B's text part: linear RoPE scaling 8 on the global layers; head_dim shrunk 256 -> 128 while
    # query_pre_attn_scalar stays 256, so the scale is not head_dim's (as Gemma 2/3 27B).
    "gemma3-4b": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=128, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
        sliding_window=8, sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, attn_logit_softcapping=None,
        final_logit_softcapping=None, rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
    )),
    # Mixture-of-experts families. Mixtral-8x7B: 8 experts, top-2 renormalised, untied. Qwen3-30B-A3B: top-8 with
    # norm_topk_prob, per-head q/k norm (128 experts, shrunk to 16). OLMoE-1B-7B: top-8 without renormalisation, q/k
    # norm over the whole projection (64 experts, shrunk to 16). Qwen1.5-MoE-A2.7B: top-4 of 60 (shrunk to 12), a
    # sigmoid-gated shared expert 4x an expert's width, q/k/v biases.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1000000.0,
        sliding_window=None, router_jitter_noise=0.0,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=8, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=None, rms_norm_eps=1e-6,
    )),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=8, intermediate_size=32, norm_topk_prob=False, clip_qkv=None,
        tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=1,
    )),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=12, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=128,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        use_sliding_window=False, rms_norm_eps=1e-6,
    )),
}
_FAMILIES = tuple(_FAMILY_CONFIGS)


def tiny_hf_config(family: str = "llama", **overrides):
    """The transformers config object make_tiny_hf_model builds (not saved)."""
    import transformers

    if family not in _FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; expected one of {_FAMILIES}")
    class_name, architecture, family_keys = _FAMILY_CONFIGS[family]
    # a deep copy: transformers rewrites a config's rope_scaling dict in place (phi3's longrope gains rope_theta)
    kwargs = copy.deepcopy({**_TINY_DEFAULTS, **family_keys, **overrides})
    if "head_dim" not in kwargs:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    config = getattr(transformers, class_name)(**kwargs)
    config.architectures = [architecture]
    return config


def make_tiny_hf_model(tmp_path, family: str = "llama", **overrides) -> Path:
    """Write a tiny random HF checkpoint + tokenizer to ``tmp_path / family``; return the dir."""
    from transformers import AutoModelForCausalLM

    seed = overrides.pop("seed", 0)
    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model, seed)
    out = Path(tmp_path) / family
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tiny_tokenizer(out)
    return out


def load_hf_reference(model_dir):
    """transformers' model as the golden tests' reference: fp32, eager attention, and the experts as the plain
    per-expert loop, the model's arithmetic written out (transformers' CPU default is torch's grouped_mm kernel)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", experts_implementation="eager",
                                                dtype=torch.float32).eval()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    norm_offset = 0.0 if model.config.model_type.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + w
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(norm_offset + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:  # linear weight [out, in], or a stack of them [experts, out, in]
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))


def write_tiny_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer: 3 special tokens (ids 0-2), the 256 byte symbols, 2 merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    vocab.update({ch: len(TINY_SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    for left, right in TINY_MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(TINY_MERGES)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": TINY_SPECIAL_TOKENS[TINY_BOS_ID],
        "eos_token": TINY_SPECIAL_TOKENS[TINY_EOS_ID],
        "unk_token": None,
        "pad_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": TINY_CHAT_TEMPLATE,
        "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def load_script(path: Path, name: str):
    """A script outside the package (benchmarks/...) imported as module `name`, registered in sys.modules first
    (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
