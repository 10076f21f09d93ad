"""GGUF -> Checkpoint: metadata to ModelSpec, tensors dequantized to float32 under Hugging Face names
(what each architecture's conversion changed undone by export/gguf_architectures.py), and the
tokenizer metadata converted to a `tokenizers` tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .checkpoint_types import Checkpoint, TokenizerFiles, select_weights
from .gguf_architectures import ROPE_TENSORS, gguf_architecture

# Large arrays the tokenizer converter reads itself; the metadata dict leaves them out.
_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"
)


def load_gguf(path: Path) -> Checkpoint:
    reader = _open(path)
    metadata = _metadata(reader, path)
    architecture = gguf_architecture(metadata.get("general.architecture"), path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    try:
        raw = {t.name: _dequantize(t) for t in reader.tensors}
    except Exception as exc:
        raise ValueError(f"{path}: truncated or corrupt GGUF tensor data ({_first_line(exc)})") from None
    spec = architecture.spec(metadata, shapes, {n: raw.pop(n) for n in ROPE_TENSORS if n in raw}, path)
    weights = {}
    for name, tensor in raw.items():
        weights.update(architecture.hf_tensors(name, tensor, spec, path))
    weights = select_weights(spec, weights, str(path))
    return Checkpoint(spec=spec, weights=weights, tokenizer=_tokenizer(path, metadata), source=str(path))


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


def _dequantize(tensor) -> torch.Tensor:
    from gguf import dequantize

    array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


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
