"""LlavaForConditionalGeneration checkpoints (and LlavaNextForConditionalGeneration's, whose text decoder, tower
and projector are the same): the text decoder's config, and the vision tower's as kiln compiles it.

A LLaVA config.json nests a Llama or Mistral ``text_config`` and a CLIP ``vision_config``; llava-hf's checkpoints
spell out only the keys that differ from transformers' defaults (the 7B's vision_config lists sizes but not its
activation or norm epsilon), so the defaults of LlamaConfig / MistralConfig and CLIPVisionConfig fill the rest here.

The weights sit under ``language_model.model.*`` / ``model.language_model.*`` (the decoder), ``vision_tower.*``
(``vision_tower.vision_model.*`` in transformers < 5 saves) and ``multi_modal_projector.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint_types import LazyWeights, TensorSource

ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")

# transformers' LlamaConfig / CLIPVisionConfig defaults, for the keys a sparse nested config leaves out. No
# rope_theta: a transformers >= 5 save nests it in rope_parameters, which a default here would override
# (ModelSpec.from_hf_config reads either, and defaults it to LlamaConfig's 10000).
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "model_type": "llama",
}
_MISTRAL_DEFAULTS: dict[str, Any] = {  # MistralConfig's (llava-v1.6-mistral-7b's text_config lists a few sizes only)
    **LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "sliding_window": 4096, "model_type": "mistral",
}
_TEXT_DEFAULTS = {"llama": (LLAMA_DEFAULTS, "LlamaForCausalLM"), "mistral": (_MISTRAL_DEFAULTS, "MistralForCausalLM")}
_CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
}
_VISION_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                    "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def is_llava(config: dict[str, Any]) -> bool:
    """LLaVA-1.5 or LLaVA-NeXT: the same text decoder, tower and projector weights."""
    return any(name in ARCHITECTURES for name in config.get("architectures") or [])


def llava_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text_config as a LlamaForCausalLM / MistralForCausalLM config.json would hold it."""
    text = dict(config.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind not in _TEXT_DEFAULTS:
        raise ValueError(f"a LLaVA text model of type {kind!r}; kiln compiles LLaVA's {' or '.join(_TEXT_DEFAULTS)} "
                         "body")
    defaults, architecture = _TEXT_DEFAULTS[kind]
    text = {**defaults, **text}
    text.setdefault("num_key_value_heads", text["num_attention_heads"])
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    text["architectures"] = [architecture]
    return text


@dataclass(frozen=True)
class ClipTowerSpec:
    """The CLIP vision tower up to the feature layer LLaVA reads, and the projector after it."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int  # encoder layers computed: those up to the feature layer (the rest never reach the projector)
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    drop_cls: bool  # vision_feature_select_strategy "default"; "full" keeps the CLS row
    projector_act: str
    projector_bias: bool
    text_hidden_size: int

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (0 if self.drop_cls else 1)


def clip_tower_spec(config: dict[str, Any]) -> ClipTowerSpec:
    vision = {**_CLIP_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: kiln compiles one feature layer (LLaVA-1.5's -2)")
    total = vision["num_hidden_layers"]
    computed = total + 1 + layer if layer < 0 else layer  # hidden_states[0] is the embeddings
    if not 0 <= computed <= total:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {total} layers")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not 'default' or 'full'")
    return ClipTowerSpec(
        hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
        num_heads=vision["num_attention_heads"], num_layers=computed, image_size=vision["image_size"],
        patch_size=vision["patch_size"], num_channels=vision["num_channels"],
        layer_norm_eps=float(vision["layer_norm_eps"]), hidden_act=vision["hidden_act"],
        drop_cls=strategy == "default", projector_act=config.get("projector_hidden_act", "gelu"),
        projector_bias=bool(config.get("multimodal_projector_bias", True)),
        text_hidden_size=llava_text_config(config)["hidden_size"],
    )


def vision_part(weights: LazyWeights) -> LazyWeights:
    """The vision tower's weights under ``tower.*`` (CLIPVisionTransformer's names), the projector's under
    ``projector.*``; the decoder left out."""
    kept: dict[str, TensorSource] = {}
    for name, source in weights.sources().items():
        for prefix in _PROJECTOR_PREFIXES:
            if name.startswith(prefix):
                kept["projector." + name[len(prefix):]] = source
                break
        else:
            for prefix in _VISION_PREFIXES:
                if name.startswith(prefix):
                    kept["tower." + name[len(prefix):]] = source
                    break
    return LazyWeights(kept)
