"""GGUF -> Checkpoint: metadata to ModelSpec, tensors under Hugging Face names, each read from the file
and dequantized to float32 only when asked for (every type gguf-py dequantizes, in any per-tensor mix; what
each architecture's conversion changed is undone by export/gguf_architectures.py), and the tokenizer
metadata converted to a `tokenizers` tokenizer.json."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kiln.spec import ModelSpec

from .checkpoint_types import Checkpoint, LazyWeights, TokenizerFiles, select_weights
from .fused_weights import split_fused_projections
from .gguf_architectures import ROPE_TENSORS, GgufArchitecture, gguf_architecture
from .moe_weights import stack_experts
from .tensor_files import GgufTensor

# Large arrays the tokenizer converter reads itself; the metadata dict leaves them out.
_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"
)


def load_gguf(path: Path) -> Checkpoint:
    reader = _open(path)
    metadata = _metadata(reader, path)
    architecture = gguf_architecture(metadata.get("general.architecture"), path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    sources = _tensor_sources(reader, path, shapes)
    del reader  # and its memory map: the tensors are read with file reads (tensor_files.py)
    rope = {name: _read(sources.pop(name), path) for name in ROPE_TENSORS if name in sources}
    spec = architecture.spec(metadata, shapes, rope, path)
    hf_sources = {architecture.hf_name(name, path): _with_rotary(architecture, name, source, spec)
                  for name, source in sources.items()}
    weights = split_fused_projections(spec, LazyWeights(hf_sources), str(path))
    weights = stack_experts(spec, weights, str(path))
    weights = select_weights(spec, weights, str(path))
    return Checkpoint(spec=spec, weights=weights, tokenizer=_tokenizer(path, metadata), source=str(path))


def _tensor_sources(reader, path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, GgufTensor]:
    """Where each tensor's blocks lie (checked against the file's size and gguf-py's types)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    size = path.stat().st_size
    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    sources = {}
    for t in reader.tensors:
        offset, nbytes, qtype = int(t.data_offset), int(t.n_bytes), GGMLQuantizationType(int(t.tensor_type))
        if qtype not in plain and qtype not in _type_traits:
            raise ValueError(f"{path}: tensor {t.name} is {qtype.name}, which gguf-py cannot dequantize")
        if offset + nbytes > size:
            raise ValueError(f"{path}: truncated or corrupt GGUF tensor data ({t.name} ends at byte "
                             f"{offset + nbytes}, the file has {size})")
        sources[t.name] = GgufTensor(path, offset, nbytes, int(qtype), shapes[t.name])
    return sources


def _with_rotary(architecture: GgufArchitecture, name: str, source: GgufTensor, spec: ModelSpec) -> GgufTensor:
    """q/k rows get llama.cpp's rotary permutation undone when read (the architectures that permuted them)."""
    heads = architecture.rotary_heads(name, spec)
    return dataclasses.replace(source, rotary_heads=heads) if heads else source


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
    config["model_max_length"] = int(md.get(f"{md['general.architecture']}.context_length", 2048))
    bos, eos = config.get("bos_token"), config.get("eos_token")
    # Make tokenizer.json itself add BOS/EOS the way the model expects, so its users need no flag.
    add_bos, add_eos = bool(config["add_bos_token"] and bos), bool(config["add_eos_token"] and eos)
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    if single != "$A:0":
        specials = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t]
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return TokenizerFiles(tokenizer_json=tokenizer.to_str(), tokenizer_config=config)
