"""Tiny GGUF files converted from make_tiny_hf_model's checkpoints the way llama.cpp's convert_hf_to_gguf.py
does, per architecture:

    gguf_path, hf_dir = make_tiny_gguf(tmp_path, "qwen3", tie_word_embeddings=False)

- llama: tensors renamed, attn_q / attn_k rows permuted to interleaved pairs, linear rope scaling as metadata
  and llama3 as a rope_freqs tensor (qwen2 / qwen3: linear and YaRN scaling as metadata too);
- qwen2 / qwen3: tensors renamed only (NEOX rotary), biases and attn_q_norm / attn_k_norm kept, head_dim as
  attention.key_length / value_length;
- phi3 (Phi-3 and Phi-4-mini): the fused qkv_proj / gate_up_proj as attn_qkv / ffn_up, rope.dimension_count
  for partial rotary, LongRoPE as rope_factors_long / rope_factors_short with original_context_length and the
  attention factor sqrt(1 + ln(max / original) / ln(original)), and attention.sliding_window.
- gemma2 / gemma3: every ``*norm.weight`` stored with Gemma's 1 added; the block norms as attn_norm,
  post_attention_norm, ffn_norm (pre-feedforward) and post_ffw_norm; head_dim as key/value length, the soft-caps
  (gemma2 both, gemma3 the final one when set) and attention.sliding_window; gemma2 without rope.freq_base (llama.cpp
  takes 10000), gemma3 with the global layers' base and linear rope scaling as metadata. (The converter also trims
  token_embd to the tokenizer's vocabulary; the tiny tokenizer is padded to the model's, so nothing is trimmed.)
- mixtral (as llama) / qwen2_moe / qwen3_moe / olmoe: the router as ffn_gate_inp, each projection's experts stacked
  into ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, rows, cols], the shared expert as ffn_*_shexp, and
  expert_count / expert_used_count / expert_feed_forward_length / expert_shared_feed_forward_length.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from helpers import TINY_BOS_ID, TINY_CHAT_TEMPLATE, TINY_EOS_ID, TINY_MERGES, TINY_SPECIAL_TOKENS, make_tiny_hf_model

# HF family -> the GGUF architecture llama.cpp's converter writes it as.
GGUF_ARCHITECTURE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "phi4": "phi3",
                     "gemma2": "gemma2", "gemma3": "gemma3", "gemma3-4b": "gemma3",
                     "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}

_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_norm": "post_attention_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Per-expert projections, stacked over the experts into one tensor each (as the converter's experts merge does).
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def llama_cpp_permute(weights, num_heads: int):
    """llama.cpp's convert_hf_to_gguf permutation of attn_q / attn_k rows (numpy or torch)."""
    rows = weights.shape[0]
    w = weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def make_tiny_gguf(tmp_path, family: str = "llama", architecture: str | None = None, quantize=None,
                   file_weights_in_hf: bool = False, **overrides) -> tuple[Path, Path]:
    """Convert make_tiny_hf_model(tmp_path, family, **overrides) to an F32 GGUF as llama.cpp does.
    Returns (gguf_path, hf_dir). ``architecture`` overrides only the metadata's name (for error tests).
    ``quantize(gguf_name, array)`` -> None (keep F32) or (ggml type, uint8 [rows, row bytes]) stores a matrix (or an
    expert stack [E, rows, cols] as uint8 [E, rows, row bytes]) as quantized blocks instead (after the q/k
    permutation, as llama.cpp quantizes the converted file). With ``file_weights_in_hf`` the returned checkpoint
    holds the file's weights (its blocks dequantized): the golden reference of an engine built from the file
    (families without llama's q/k permutation)."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file

    hf_dir = make_tiny_hf_model(tmp_path, family, **overrides)
    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    arch = GGUF_ARCHITECTURE[family]
    path = Path(tmp_path) / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    writer.add_name(f"tiny {family}")
    _add_hparams(writer, arch, config)
    _add_tiny_gguf_tokenizer(writer, hf_dir, config["vocab_size"])
    if arch in ("llama", "qwen2", "qwen3", "gemma3"):
        _add_gguf_rope_scaling(writer, config)
    if arch == "phi3":
        _add_longrope(writer, config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    experts: dict[str, dict[int, object]] = {}
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        gemma = arch.startswith("gemma")
        if gemma and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
        if gemma and name == "lm_head.weight":
            continue  # the converter skips it (Gemma ties the head)
        if ".experts." in name:  # model.layers.{i}.(mlp|block_sparse_moe).experts.{j}.{proj}.weight
            _, _, layer, _, _, index, proj, _ = name.split(".")
            experts.setdefault(f"blk.{layer}.{_EXPERT_NAMES[proj]}.weight", {})[int(index)] = (name, array)
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if gemma and module == "post_attention_layernorm":  # Gemma's norms after attention, not before the MLP
                module = "post_attention_norm"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                array = llama_cpp_permute(array, heads if module == "self_attn.q_proj" else kv_heads)
            gguf_name = f"blk.{layer}.{_BLOCK_NAMES[module]}.{kind}"
        else:
            gguf_name = _GLOBAL_NAMES[name]
        blocks = quantize(gguf_name, array) if quantize is not None and array.ndim == 2 else None
        if blocks is None:
            writer.add_tensor(gguf_name, array.copy())
        else:
            kind, data = blocks
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType(int(kind)))
            if file_weights_in_hf:
                weights[name] = torch.from_numpy(dequantize(data, gguf.GGMLQuantizationType(int(kind))))
    for gguf_name, by_index in experts.items():
        names, arrays = zip(*(by_index[j] for j in range(len(by_index))), strict=True)
        stack = np.stack(arrays)
        blocks = quantize(gguf_name, stack) if quantize is not None else None
        if blocks is None:
            writer.add_tensor(gguf_name, stack)
        else:
            kind, data = blocks
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType(int(kind)))
            if file_weights_in_hf:
                for name, expert in zip(names, dequantize(data, gguf.GGMLQuantizationType(int(kind))), strict=True):
                    weights[name] = torch.from_numpy(np.ascontiguousarray(expert))
    if file_weights_in_hf:
        if arch == "llama":
            raise ValueError("file_weights_in_hf: llama's q/k rows are permuted in the file")
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(hf_dir / "model.safetensors"),
                  metadata={"format": "pt"})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf_dir


def _add_hparams(writer, arch: str, config: dict) -> None:
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    if arch != "gemma2":  # its converter writes no base: llama.cpp's default 10000 is Gemma 2's
        full = rope.get("full_attention", rope)  # Gemma 3 (transformers >= 5): one set per layer type
        writer.add_rope_freq_base(full.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(config["head_dim"] or config["hidden_size"] // heads)
        writer.add_vocab_size(config["vocab_size"])
    elif arch.startswith("gemma"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        elif config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    elif arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe"):
        if config.get("head_dim") is not None:
            writer.add_key_length(config["head_dim"])
            writer.add_value_length(config["head_dim"])
    else:  # phi3
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // heads)
        writer.add_sliding_window(config.get("sliding_window") or 0)


def _add_longrope(writer, config: dict) -> None:
    import numpy as np

    rope = config.get("rope_parameters") or {}
    original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    writer.add_rope_scaling_orig_ctx_len(original or config["max_position_embeddings"])
    if not rope.get("long_factor"):
        return
    scale = config["max_position_embeddings"] / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


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
    """As llama.cpp's convert does: linear and YaRN scaling as metadata, llama3 as a rope_freqs tensor."""
    import gguf
    import numpy as np

    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (the local ones are never scaled)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
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

