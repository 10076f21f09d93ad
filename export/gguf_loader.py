"""GGUF (llama architecture) -> Checkpoint: metadata to ModelSpec, tensors under Hugging Face names
(each dequantized to float32 when read, llama.cpp's rotary row permutation of attn_q/attn_k undone;
every type gguf-py dequantizes, in any per-tensor mix), and the tokenizer metadata converted to a
`tokenizers` tokenizer.json."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from kiln.spec import ModelSpec, RopeScaling

from .checkpoint_types import Checkpoint, LazyWeights, TokenizerFiles, select_weights
from .tensor_files import GgufTensor, unpermute_rotary_rows

__all__ = ["load_gguf", "unpermute_rotary_rows"]

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
# Large arrays the tokenizer converter reads itself; the metadata dict leaves them out.
_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def load_gguf(path: Path) -> Checkpoint:
    reader = _open(path)
    metadata = _metadata(reader, path)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r} (kiln reads {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    spec = _spec_from_metadata(metadata, shapes, path)
    sources = _tensor_sources(reader, path, shapes, spec)
    del reader  # and its memory map: the tensors are read with file reads (tensor_files.py)
    freqs = sources.pop("rope_freqs.weight", None)
    if freqs is not None:
        spec = _with_llama3_scaling(spec, _read(freqs, path), path)
    weights = LazyWeights({_hf_name(name, path): source for name, source in sources.items()})
    weights = select_weights(spec, weights, str(path))
    return Checkpoint(spec=spec, weights=weights, tokenizer=_tokenizer(path, metadata), source=str(path))


def _tensor_sources(reader, path: Path, shapes: dict[str, tuple[int, ...]], spec: ModelSpec) -> dict[str, GgufTensor]:
    """Where each tensor's blocks lie; q/k rows get llama.cpp's rotary permutation undone when read."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    size = path.stat().st_size
    heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}
    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    sources = {}
    for t in reader.tensors:
        offset, nbytes, qtype = int(t.data_offset), int(t.n_bytes), GGMLQuantizationType(int(t.tensor_type))
        if qtype not in plain and qtype not in _type_traits:
            raise ValueError(f"{path}: tensor {t.name} is {qtype.name}, which gguf-py cannot dequantize")
        if offset + nbytes > size:
            raise ValueError(f"{path}: truncated or corrupt GGUF tensor data ({t.name} ends at byte "
                             f"{offset + nbytes}, the file has {size})")
        match = _BLOCK_RE.match(t.name)
        rotary = heads.get(match.group(2), 0) if match else 0
        sources[t.name] = GgufTensor(path, offset, nbytes, int(qtype), shapes[t.name], rotary)
    return sources


def _read(source: GgufTensor, path: Path) -> torch.Tensor:
    try:
        return source.read()
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: truncated or corrupt GGUF tensor data ({_first_line(exc)})") from None


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError / IndexError / numpy errors on damage
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({_first_line(exc)})") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _metadata(reader, path: Path) -> dict:
    values = {}
    for key, field in reader.fields.items():
        if key in _TOKENIZER_ARRAYS:
            continue
        try:
            values[key] = field.contents()
        except Exception as exc:
            raise ValueError(f"{path}: unreadable GGUF metadata {key!r} ({_first_line(exc)})") from None
    return values


def _nice_float(value: float) -> float:
    """GGUF stores float32; 9.999999747e-06 -> 1e-05."""
    return float(str(np.float32(value)))


def _spec_from_metadata(md: dict, shapes: dict[str, tuple[int, ...]], path: Path) -> ModelSpec:
    def get(key, default=None):
        value = md.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks llama.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(md.get("llama.attention.key_length") or hidden // num_heads)
    rope_dim = int(md.get("llama.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"{path}: partial rotary embeddings (rope dim {rope_dim} of head dim {head_dim}) are not supported"
        )
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    vocab = md.get("llama.vocab_size") or shapes["token_embd.weight"][0]
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos_ids = tuple(
        dict.fromkeys(int(md[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md)
    )
    try:
        return ModelSpec(
            family="llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(md.get("llama.attention.head_count_kv") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=_nice_float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=_nice_float(md.get("llama.rope.freq_base", 10000.0)),
            max_position_embeddings=int(md.get("llama.context_length", 2048)),
            tie_word_embeddings="output.weight" not in shapes,
            attention_bias="blk.0.attn_q.bias" in shapes,
            rope_scaling=_rope_scaling(md, path),
            sliding_window=0,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad GGUF metadata ({_first_line(exc)})") from None


def _rope_scaling(md: dict, path: Path) -> RopeScaling | None:
    kind = md.get("llama.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"{path}: unsupported GGUF rope scaling {kind!r} (kiln supports linear and llama3)")
    factor = md.get("llama.rope.scaling.factor")
    return RopeScaling(rope_type="linear", factor=_nice_float(factor)) if factor and factor != 1.0 else None


def _with_llama3_scaling(spec: ModelSpec, freqs: torch.Tensor, path: Path) -> ModelSpec:
    """llama.cpp bakes Llama 3 rope scaling into a rope_freqs tensor (per-frequency divisors);
    recover the llama3 parameters that reproduce it."""
    import dataclasses

    from .reference import rope_inv_freq

    freqs = freqs.reshape(-1).to(torch.float64)
    base = rope_inv_freq(dataclasses.replace(spec, rope_scaling=None)).to(torch.float64)
    if freqs.shape != base.shape:
        raise ValueError(f"{path}: rope_freqs has {freqs.numel()} entries, expected {base.numel()}")
    if torch.allclose(freqs, torch.ones_like(freqs)):
        return spec
    factor = float(freqs.max())
    # Any parameters that reproduce the divisors give the same inv_freq, hence the same model.
    for original in [spec.max_position_embeddings] + [2**k for k in range(4, 21)]:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            scaling = RopeScaling("llama3", factor, low, high, original)
            scaled = rope_inv_freq(dataclasses.replace(spec, rope_scaling=scaling)).to(torch.float64)
            if torch.allclose(base / scaled, freqs, rtol=1e-3):
                return dataclasses.replace(spec, rope_scaling=scaling)
    raise ValueError(f"{path}: rope_freqs does not match any llama3 rope scaling kiln can express")


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    raise ValueError(f"{path}: unexpected GGUF tensor {name!r} for a llama model")


def _tokenizer(path: Path, md: dict) -> TokenizerFiles | None:
    if "tokenizer.ggml.model" not in md:
        return None
    from tokenizers import processors
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, tokenizer_dict, config = get_gguf_tokenizer(str(path))
        tokenizer, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as exc:
        raise ValueError(f"{path}: cannot convert the GGUF tokenizer ({_first_line(exc)})") from None
    config = dict(config)
    config.setdefault("add_bos_token", False)
    config.setdefault("add_eos_token", False)
    config["model_max_length"] = int(md.get("llama.context_length", 2048))
    bos, eos = config.get("bos_token"), config.get("eos_token")
    # Make tokenizer.json itself add BOS/EOS the way the model expects, so its users need no flag.
    add_bos, add_eos = bool(config["add_bos_token"] and bos), bool(config["add_eos_token"] and eos)
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    if single != "$A:0":
        specials = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t]
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return TokenizerFiles(tokenizer_json=tokenizer.to_str(), tokenizer_config=config)
