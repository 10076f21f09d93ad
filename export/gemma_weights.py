"""Gemma checkpoints as kiln's reference model reads them.

Gemma's RMSNorms compute ``norm(x) * (1 + w)`` (transformers' Gemma2RMSNorm / Gemma3RMSNorm, in float32).
kiln folds the 1 into the weight when it loads a Hugging Face checkpoint, so that the graph holds a plain
RMSNorm (``norm(x) * w'``) that the norm fusions and calibration's smoothing treat like any other: the fold is
exact in float32 (the same single addition transformers does). llama.cpp's converter stores ``w + 1`` in GGUF
files already, so GGUF weights pass unchanged.

Gemma3ForConditionalGeneration checkpoints carry the text decoder under ``language_model`` (next to the
vision tower and projector, which kiln does not compile); ``text_part`` keeps the decoder's weights under
Gemma3ForCausalLM's names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kiln.spec import GEMMA_FAMILIES, ModelSpec

from .checkpoint_types import LazyWeights, TensorSource

# Every norm weight of a Gemma decoder: the four of each block, q_norm / k_norm (Gemma 3) and the final one.
_NORM = re.compile(r"^model\.(norm|layers\.\d+\.(\w+_layernorm|self_attn\.[qk]_norm))\.weight$")
# transformers >= 5 saves "model.language_model.*"; earlier versions "language_model.model.*".
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


@dataclass(frozen=True)
class PlusOne:
    """A norm weight read with Gemma's 1 added, in float32."""

    source: TensorSource

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    def read(self) -> torch.Tensor:
        return self.source.read().to(torch.float32) + 1.0


def fold_norm_offsets(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """weights with 1 added to every norm weight of a Gemma family's Hugging Face checkpoint (others unchanged);
    lazy weights stay lazy."""
    if spec.family not in GEMMA_FAMILIES:
        return weights
    if isinstance(weights, LazyWeights):
        sources = weights.sources()
        return LazyWeights({name: PlusOne(src) if _NORM.match(name) else src for name, src in sources.items()})
    return {name: w.to(torch.float32) + 1.0 if _NORM.match(name) else w for name, w in weights.items()}


def is_multimodal_gemma3(config: dict[str, Any]) -> bool:
    return "Gemma3ForConditionalGeneration" in (config.get("architectures") or [])


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma3ForConditionalGeneration's text_config as a Gemma3ForCausalLM config.json would hold it (the
    outer config's token ids and tying filled in where the text part leaves them out)."""
    text = dict(config.get("text_config") or {})
    if "num_hidden_layers" not in text:
        raise ValueError("a Gemma3ForConditionalGeneration config without text_config.num_hidden_layers")
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if key not in text and key in config:
            text[key] = config[key]
    text["architectures"] = ["Gemma3ForCausalLM"]
    return text


def text_part(weights: LazyWeights) -> LazyWeights:
    """The decoder's weights under Gemma3ForCausalLM's names; the vision tower and projector left out."""
    kept: dict[str, TensorSource] = {}
    for name, source in weights.sources().items():
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                kept["model." + name[len(prefix):]] = source
        if name == "lm_head.weight" or name == "language_model.lm_head.weight":
            kept["lm_head.weight"] = source
    return LazyWeights(kept)
