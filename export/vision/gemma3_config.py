"""Gemma3ForConditionalGeneration checkpoints: the SigLIP tower + Gemma3MultiModalProjector as kiln compiles them.

The text decoder is export/gemma_weights.py's (Gemma3ForCausalLM under ``language_model``). The image side is a
SigLIP vision model (no head) whose last hidden state, post-layernormed, is average-pooled from its
``image_size / patch_size`` square of patches down to ``mm_tokens_per_image`` (a square: gemma-3-4b-it's 64 x 64
patches -> 16 x 16 = 256 tokens), RMS-normed with Gemma's ``(1 + w)`` and projected by
``mm_input_projection_weight [vision_hidden, text_hidden]``.

Weight names: the checkpoints on the hub hold ``vision_tower.vision_model.*`` and ``multi_modal_projector.*``;
transformers 5 writes ``vision_tower.*`` (no ``vision_model``), and in memory it names them under ``model.``: every
one of these is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..checkpoint_types import LazyWeights, TensorSource
from ..gemma_weights import is_multimodal_gemma3

_VISION_DEFAULTS: dict[str, Any] = {  # SiglipVisionConfig's, as Gemma3Config fills them in
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_channels": 3, "image_size": 896, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower.")  # longest first
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")

is_gemma3 = is_multimodal_gemma3


@dataclass(frozen=True)
class Gemma3TowerSpec:
    """The SigLIP tower (every layer, then post_layernorm) and the pooling projector after it."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    tokens_per_image: int  # mm_tokens_per_image
    text_hidden_size: int

    def __post_init__(self) -> None:
        side, pooled = self.image_size // self.patch_size, math.isqrt(self.tokens_per_image)
        if self.image_size % self.patch_size or pooled * pooled != self.tokens_per_image or side % pooled:
            raise ValueError(f"a Gemma 3 tower of {self.image_size} pixels, patch {self.patch_size}: its {side} x "
                             f"{side} patches do not average-pool to mm_tokens_per_image {self.tokens_per_image} "
                             "(a square whose side divides the patches' side)")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool_kernel(self) -> int:
        return self.patches_per_side // math.isqrt(self.tokens_per_image)


def gemma3_tower_spec(config: dict[str, Any], processor: dict[str, Any]) -> Gemma3TowerSpec:
    vision = {**_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    size = processor.get("size") or {}
    if (size.get("height"), size.get("width")) != (vision["image_size"], vision["image_size"]):
        raise ValueError(f"the image processor's size {size!r} is not the vision tower's image_size "
                         f"{vision['image_size']} square (kiln resizes every image to the tower's size)")
    if processor.get("do_pan_and_scan"):
        raise ValueError("the image processor has do_pan_and_scan on; kiln does not build Gemma 3's pan-and-scan "
                         "crops")
    text = config.get("text_config") or {}
    tokens = config.get("mm_tokens_per_image", 256)
    return Gemma3TowerSpec(
        hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
        num_heads=vision["num_attention_heads"], num_layers=vision["num_hidden_layers"],
        image_size=vision["image_size"], patch_size=vision["patch_size"], num_channels=vision["num_channels"],
        layer_norm_eps=float(vision["layer_norm_eps"]), hidden_act=vision["hidden_act"], tokens_per_image=tokens,
        text_hidden_size=text.get("hidden_size", 2304),
    )


def vision_part(weights: LazyWeights) -> LazyWeights:
    """The tower's weights under ``tower.*`` (SiglipVisionTransformer's names), the projector's under
    ``projector.*``; the decoder left out."""
    kept: dict[str, TensorSource] = {}
    for name, source in weights.sources().items():
        for prefix, into in [(p, "tower.") for p in _TOWER_PREFIXES] + [(p, "projector.") for p in _PROJECTOR_PREFIXES]:
            if name.startswith(prefix):
                kept[into + name[len(prefix):]] = source
                break
    return LazyWeights(kept)
