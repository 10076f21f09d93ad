"""Idefics3ForConditionalGeneration / SmolVLMForConditionalGeneration checkpoints: the text decoder's config, and
the SigLIP tower + connector as kiln compiles them.

Both nest a Llama ``text_config`` (SmolVLM's is a SmolLM2) and a SigLIP-style ``vision_config``; a sparse
nested config is filled from transformers' LlamaConfig / Idefics3VisionConfig defaults. The connector pixel-shuffles
the tower's [patches, hidden] output by ``scale_factor`` (patches / scale^2 rows of hidden * scale^2) and projects
it with one bias-free linear layer, so a tile of ``image_size`` pixels gives
``(image_size / patch_size)^2 / scale_factor^2`` embeddings (SmolVLM-256M: 512 / 16, scale 4 -> 64).

The weights sit under ``model.text_model.*`` (the decoder) and ``lm_head.*``, ``model.vision_model.*`` (the tower)
and ``model.connector.modality_projection.proj.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint_types import LazyWeights, TensorSource
from .llava_config import LLAMA_DEFAULTS

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")

_VISION_DEFAULTS: dict[str, Any] = {  # Idefics3VisionConfig's (SmolVLMVisionConfig's are the same)
    "hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 16,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
_TEXT_PREFIX = "model.text_model."
_VISION_PREFIX = "model.vision_model."
_CONNECTOR_PREFIX = "model.connector.modality_projection."


def is_idefics3(config: dict[str, Any]) -> bool:
    return any(name in ARCHITECTURES for name in config.get("architectures") or [])


def idefics3_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text_config as a LlamaForCausalLM config.json would hold it."""
    text = {**LLAMA_DEFAULTS, **(config.get("text_config") or {})}
    if text.get("model_type") != "llama":
        raise ValueError(f"an Idefics3 text model of type {text.get('model_type')!r}; kiln compiles its llama body")
    text.setdefault("num_key_value_heads", text["num_attention_heads"])
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    text["architectures"] = ["LlamaForCausalLM"]
    return text


def text_part(weights: LazyWeights) -> LazyWeights:
    """The decoder's weights under LlamaForCausalLM's names; the tower and connector left out."""
    kept: dict[str, TensorSource] = {}
    for name, source in weights.sources().items():
        if name.startswith(_TEXT_PREFIX):
            kept["model." + name[len(_TEXT_PREFIX):]] = source
        elif name == "lm_head.weight":
            kept[name] = source
    return LazyWeights(kept)


@dataclass(frozen=True)
class SiglipTowerSpec:
    """The SigLIP tower (every layer, then post_layernorm) and the pixel-shuffle connector after it."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    image_size: int  # one tile's side: the processor's max_image_size
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int
    text_hidden_size: int

    def __post_init__(self) -> None:
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError(f"an Idefics3 tile of {self.image_size} pixels, patch {self.patch_size}: the "
                             f"{side} patches a side do not pixel-shuffle by scale_factor {self.scale_factor}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        return self.patches_per_side**2 // self.scale_factor**2


def siglip_tower_spec(config: dict[str, Any], processor: dict[str, Any]) -> SiglipTowerSpec:
    vision = {**_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    tile = (processor.get("max_image_size") or {}).get("longest_edge", vision["image_size"])
    if tile != vision["image_size"]:
        raise ValueError(f"the image processor's max_image_size {tile} is not the vision tower's image_size "
                         f"{vision['image_size']} (kiln compiles tiles of the tower's size)")
    scale = config.get("scale_factor", 2)
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale_factor {scale!r} must be a positive integer")
    return SiglipTowerSpec(
        hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
        num_heads=vision["num_attention_heads"], num_layers=vision["num_hidden_layers"],
        image_size=vision["image_size"], patch_size=vision["patch_size"], num_channels=vision["num_channels"],
        layer_norm_eps=float(vision["layer_norm_eps"]), hidden_act=vision["hidden_act"], scale_factor=scale,
        text_hidden_size=idefics3_text_config(config)["hidden_size"],
    )


def vision_part(weights: LazyWeights) -> LazyWeights:
    """The tower's weights under ``tower.*`` (Idefics3VisionTransformer's names), the connector's projection under
    ``projector.*``; the decoder left out."""
    kept: dict[str, TensorSource] = {}
    for name, source in weights.sources().items():
        if name.startswith(_VISION_PREFIX):
            kept["tower." + name[len(_VISION_PREFIX):]] = source
        elif name.startswith(_CONNECTOR_PREFIX):
            kept["projector." + name[len(_CONNECTOR_PREFIX):]] = source
    return LazyWeights(kept)
