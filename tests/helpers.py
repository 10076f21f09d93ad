"""Shared test helpers: tiny random Hugging Face checkpoints for every supported family.

    path = make_tiny_hf_model(tmp_path, family="llama", num_key_value_heads=1)

writes a 2-layer model (config.json + model.safetensors) and a small byte-level tokenizer
(tokenizer.json + tokenizer_config.json with a ChatML template) into ``tmp_path / family``,
and returns that directory. Keyword overrides go to the transformers config class
(``hidden_size``, ``num_key_value_heads``, ``tie_word_embeddings``, ``rope_scaling``,
``sliding_window``, ...); ``seed`` picks the random weights.

``make_tiny_gguf(tmp_path, **overrides)`` converts such a llama to an F32 GGUF the way
llama.cpp does (tensor names, q/k row permutation, rope scaling, tokenizer metadata).

Weights are drawn at a scale that gives O(1) logits, so numeric comparisons are meaningful
(the transformers default init of std 0.02 makes every logit nearly zero).
"""

from __future__ import annotations

import json
import math
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

_FAMILIES = ("llama", "mistral", "qwen2")


def tiny_hf_config(family: str = "llama", **overrides):
    """The transformers config object make_tiny_hf_model builds (not saved)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; expected one of {_FAMILIES}")
    kwargs = dict(_TINY_DEFAULTS)
    if family == "mistral":
        kwargs["sliding_window"] = None  # full attention unless a test asks for a window
    kwargs.update(overrides)
    if "head_dim" not in kwargs:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    config = classes[family](**kwargs)
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM"}[family]]
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


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:  # linear weight [out, in]
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))


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


def llama_cpp_permute(weights, num_heads: int):
    """llama.cpp's convert_hf_to_gguf permutation of attn_q / attn_k rows (numpy or torch)."""
    rows = weights.shape[0]
    w = weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


_GGUF_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def make_tiny_gguf(tmp_path, architecture: str = "llama", **overrides) -> tuple[Path, Path]:
    """Convert make_tiny_hf_model(tmp_path, "llama", **overrides) to an F32 GGUF the way
    llama.cpp does (renamed tensors, permuted q/k rows, tokenizer metadata).
    Returns (gguf_path, hf_dir). ``architecture`` only sets the metadata (for error tests)."""
    import gguf
    from safetensors.torch import load_file

    hf_dir = make_tiny_hf_model(tmp_path, "llama", **overrides)
    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    path = Path(tmp_path) / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tiny_gguf_tokenizer(writer, hf_dir, config["vocab_size"])
    _add_gguf_rope_scaling(writer, config)
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            if rest == "self_attn.q_proj.weight":
                array = llama_cpp_permute(array, heads)
            elif rest == "self_attn.k_proj.weight":
                array = llama_cpp_permute(array, kv_heads)
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK_NAMES[rest]}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(gguf_name, array.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf_dir


def _add_tiny_gguf_tokenizer(writer, hf_dir: Path, vocab_size: int) -> None:
    import gguf

    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    tokens = [tok for tok, _ in vocab]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types = [gguf.TokenType.CONTROL if i < len(TINY_SPECIAL_TOKENS) else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{left} {right}" for left, right in TINY_MERGES])
    writer.add_bos_token_id(TINY_BOS_ID)
    writer.add_eos_token_id(TINY_EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)


def _add_gguf_rope_scaling(writer, config: dict) -> None:
    """As llama.cpp's convert does: linear scaling as metadata, llama3 as a rope_freqs tensor."""
    import gguf
    import numpy as np

    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "llama3":
        dim = config["head_dim"]
        freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        factors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old_len / high:
                factors.append(1.0)
            elif wavelen > old_len / low:
                factors.append(factor)
            else:
                smooth = (old_len / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
