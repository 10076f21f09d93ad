"""Random-weight checkpoints in real model shapes: Hugging Face dirs written shard by shard, GGUF files
written tensor by tensor.

    write_checkpoint(SHAPES["llama-3.2-1b"], out_dir); write_smollm2_tokenizer(out_dir)
    write_random_gguf(SHAPES["llama-3.2-1b"], path, copy_gguf_tokenizer(default_model_path()))

Each shard's tensors are drawn, written as bf16 safetensors and dropped before the next shard's, so an
8B checkpoint (15 GB of bf16) is written with about one shard (SHARD_BYTES) in memory. The tokenizer is
SmolLM2's (the default model's GGUF, through kiln's loader), so every shape uses its 49152-token
vocabulary; the bodies (layers, hidden, heads, FFN) are the real models'.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SHARD_BYTES = 1 << 30
SMOLLM2_VOCAB = 49152


@dataclass(frozen=True)
class Shape:
    family: str  # llama | qwen2 | olmoe | qwen3moe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    rope_theta: float
    llama3_rope: float | None = None  # Llama 3's rope scaling factor (original context 8192)
    vocab: int = SMOLLM2_VOCAB
    experts: int = 0  # mixture of experts: experts per layer, each of width ffn
    top_k: int = 0  # mixture of experts: experts per token
    head_size: int = 0  # where a head is not hidden / heads wide (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                           p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
            if self.experts:  # q/k RMSNorm (OLMoE: over whole projections; Qwen3: per head), router, experts
                norm_q, norm_k = ((q,), (kv,)) if self.family == "olmoe" else ((self.head_dim,), (self.head_dim,))
                shapes.update({p + "self_attn.q_norm.weight": norm_q, p + "self_attn.k_norm.weight": norm_k,
                               p + "mlp.gate.weight": (self.experts, h)})
                for e in range(self.experts):
                    x = f"{p}mlp.experts.{e}."
                    shapes.update({x + "gate_proj.weight": (self.ffn, h), x + "up_proj.weight": (self.ffn, h),
                                   x + "down_proj.weight": (h, self.ffn)})
            else:
                shapes.update({p + "mlp.gate_proj.weight": (self.ffn, h), p + "mlp.up_proj.weight": (self.ffn, h),
                               p + "mlp.down_proj.weight": (h, self.ffn)})
            if self.family == "qwen2":
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab, h)
        return shapes

    def parameters(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())

    def active_parameters(self) -> int:
        """Parameters one token's step multiplies by (all but the embedding table; top_k of the experts)."""
        def used(name: str, dims: tuple[int, ...]) -> float:
            if "embed_tokens" in name and not self.tied:
                return 0
            return math.prod(dims) * (self.top_k / self.experts if ".experts." in name else 1)
        return round(sum(used(n, d) for n, d in self.weight_shapes().items()))

    def config(self) -> dict:
        config = {
            "architectures": [_HF_CLASS[self.family]], "model_type": _HF_MODEL_TYPE.get(self.family, self.family),
            "hidden_size": self.hidden, "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab,
            "rms_norm_eps": 1e-6 if self.family in ("qwen2", "qwen3moe") else 1e-5, "rope_theta": self.rope_theta,
            "max_position_embeddings": 131072 if self.llama3_rope else 32768, "tie_word_embeddings": self.tied,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        }
        if self.family == "olmoe":
            config.update({"num_experts": self.experts, "num_experts_per_tok": self.top_k, "norm_topk_prob": False,
                           "max_position_embeddings": 4096})
        elif self.experts:  # Qwen3-MoE: every layer sparse, the chosen experts' weights renormalised
            config.update({"num_experts": self.experts, "num_experts_per_tok": self.top_k, "norm_topk_prob": True,
                           "moe_intermediate_size": self.ffn, "decoder_sparse_step": 1, "mlp_only_layers": [],
                           "max_position_embeddings": 40960})
        if self.llama3_rope:
            config["rope_scaling"] = {"rope_type": "llama3", "factor": self.llama3_rope, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        return config


# A family's Hugging Face class, and its config's model_type where that differs from the family (GGUF's name)
_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "olmoe": "OlmoeForCausalLM",
             "qwen3moe": "Qwen3MoeForCausalLM"}
_HF_MODEL_TYPE = {"qwen3moe": "qwen3_moe"}

SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, tied=True, rope_theta=500000.0, llama3_rope=32.0),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, tied=True, rope_theta=500000.0, llama3_rope=32.0),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, tied=False, rope_theta=500000.0, llama3_rope=8.0),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, tied=False, rope_theta=1000000.0),
    # OLMoE-1B-7B: 6.9B parameters, 1.3B of them active per token
    "olmoe-1b-7b": Shape("olmoe", 2048, 16, 16, 16, 1024, tied=False, rope_theta=10000.0, experts=64, top_k=8),
    # Qwen3-30B-A3B: 30B parameters (29B with SmolLM2's vocabulary), 3B of them active per token
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 768, tied=False, rope_theta=1000000.0, experts=128, top_k=8,
                           head_size=128),
}


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """O(1) activations through the layers: unit-ish norms, linears scaled by 1/sqrt(fan-in)."""
    if len(shape) == 1:
        scale, offset = (0.1, 1.0) if name.endswith("norm.weight") else (0.1, 0.0)
        return (offset + scale * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    std = 0.5 if "embed_tokens" in name else 1.0 / math.sqrt(shape[1])
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def write_checkpoint(shape: Shape, out: Path, seed: int = 0) -> Path:
    """config.json and model-0000N-of-0000M.safetensors + index (no tokenizer: write_smollm2_tokenizer)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in shape.weight_shapes().items():
        nbytes = 2 * math.prod(dims)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: _draw(name, dims, gen) for name, dims in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name, _ in names})
    total = 2 * shape.parameters()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(shape.config(), indent=2))
    return out


def write_smollm2_tokenizer(out: Path) -> None:
    """tokenizer.json + tokenizer_config.json of the default model (SmolLM2's GGUF, through kiln's loader)."""
    from kiln.export.checkpoint import load_checkpoint

    tokenizer = load_checkpoint("default").tokenizer
    assert tokenizer is not None
    (out / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer.tokenizer_config, indent=2))


# Q4_K_M's per-tensor mix for random GGUFs, as llama.cpp's quantizer chooses it: Q4_K everywhere except the head
# (Q6_K) and, in the layers use_more_bits picks (the first and last eighth and every third between), attn_v and
# ffn_down (ffn_down_exps for MoE) at Q6_K. The blocks are random and valid: no quantizer runs, so an 8B file is
# written in seconds. The byte offsets are each block's float16 scales, set to small finite values (random bytes
# there could be NaN or inf).
GGUF_MORE_BITS = ("attn_v", "ffn_down", "ffn_down_exps")
GGUF_DEFAULT_TYPE = "Q4_K"
GGUF_FAMILIES = ("llama", "olmoe", "qwen3moe")  # the architectures write_random_gguf writes
_F16_FIELDS = {"Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M keeps at Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _gguf_type(name: str, dims: tuple[int, ...], layers: int) -> str:
    if len(dims) == 1 or name.endswith("ffn_gate_inp"):  # norms, and the router llama.cpp leaves float32
        return "F32"
    if name == "output":
        return "Q6_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in GGUF_MORE_BITS and use_more_bits(int(parts[1]), layers):
        return "Q6_K"
    return GGUF_DEFAULT_TYPE


def gguf_tensors(shape: Shape) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name -> (PyTorch-order shape, type) of a llama-, olmoe- or qwen3moe-architecture file of this shape."""
    if shape.family not in GGUF_FAMILIES:
        raise ValueError(f"random GGUF files are written for {GGUF_FAMILIES} only, not {shape.family}")
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    parts = {"attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
             "ffn_norm": (h,)}
    if shape.experts:  # q/k RMSNorm (OLMoE: over whole projections; Qwen3: per head), router, experts
        e, f = shape.experts, shape.ffn
        norm_q, norm_k = ((q,), (kv,)) if shape.family == "olmoe" else ((shape.head_dim,), (shape.head_dim,))
        parts.update({"attn_q_norm": norm_q, "attn_k_norm": norm_k, "ffn_gate_inp": (e, h),
                      "ffn_gate_exps": (e, f, h), "ffn_up_exps": (e, f, h), "ffn_down_exps": (e, h, f)})
    else:
        parts.update({"ffn_gate": (shape.ffn, h), "ffn_up": (shape.ffn, h), "ffn_down": (h, shape.ffn)})
    names: dict[str, tuple[int, ...]] = {"token_embd": (shape.vocab, h)}
    for i in range(shape.layers):
        names.update({f"blk.{i}.{part}": dims for part, dims in parts.items()})
    names["output_norm"] = (h,)
    if not shape.tied:
        names["output"] = (shape.vocab, h)
    return {f"{name}.weight": (dims, _gguf_type(name, dims, shape.layers)) for name, dims in names.items()}


def _random_blocks(dims: tuple[int, ...], type_name: str, rng) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    if type_name == "F32":
        return (1 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
    rows, cols = math.prod(dims[:-1]), dims[-1]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS[type_name]:
        scale = rng.uniform(0.001, 0.01, (rows, cols // block)).astype(np.float16)
        data[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(*dims[:-1], -1)


def write_random_gguf(shape: Shape, path: Path, add_tokenizer: Callable, seed: int = 0) -> int:
    """A GGUF of random valid blocks (Q4_K_M's mix; the llama, olmoe or qwen3moe architecture), written a tensor at
    a time (tensor infos first, then each tensor's data, so only one tensor is in memory); add_tokenizer(writer) adds
    the tokenizer metadata. Returns the number of parameters."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), shape.family)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.config()["max_position_embeddings"])
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.config()["rms_norm_eps"])
    writer.add_vocab_size(shape.vocab)
    if shape.experts:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.top_k)
        writer.add_expert_feed_forward_length(shape.ffn)
    add_tokenizer(writer)
    tensors = gguf_tensors(shape)
    for name, (dims, type_name) in tensors.items():
        if type_name == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * math.prod(dims))
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
            row_bytes = dims[-1] // block * size
            writer.add_tensor_info(name, (*dims[:-1], row_bytes), np.dtype(np.uint8), math.prod(dims[:-1]) * row_bytes,
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for dims, type_name in tensors.values():
        writer.write_tensor_data(_random_blocks(dims, type_name, rng))
    writer.close()
    return sum(math.prod(dims) for dims, _ in tensors.values())


def copy_gguf_tokenizer(source: Path) -> Callable:
    """add_tokenizer for write_random_gguf: the tokenizer metadata of another GGUF (SmolLM2's: the default)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    fields = {key: field for key, field in reader.fields.items() if key.startswith("tokenizer.")}

    def add(writer) -> None:
        for key, field in fields.items():
            value = field.contents()
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, kind)
    return add
