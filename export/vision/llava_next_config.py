"""LlavaNextForConditionalGeneration checkpoints ("llava-v1.6"): LLaVA's text decoder, CLIP tower and projector
(export/vision/llava_config.py), plus the any-resolution grid and the learned ``image_newline`` vector.

The processor cuts an image into tiles of the tower's ``image_size`` on the best-fitting grid of
``image_grid_pinpoints`` ([height, width] in pixels, multiples of the tile), after a base image (the whole picture
resized to one tile); the model reads the grid from the same list in config.json, so the two must agree. Packing
reshapes the tiles' features by the tower's patch grid, which is why the select strategy must be "default"
(CLS dropped: ``(image_size / patch_size)^2`` rows a tile).

The weights are LLaVA's, and ``image_newline`` (``model.image_newline`` in transformers >= 5 saves).
"""

from __future__ import annotations

from typing import Any

from ..checkpoint_types import LazyWeights
from . import llava_config
from .llava_config import ClipTowerSpec

ARCHITECTURE = "LlavaNextForConditionalGeneration"
NEWLINE = "image_newline"  # its name in the encoder module's weights
_NEWLINE_NAMES = ("image_newline", "model.image_newline")
# LlavaNextConfig's default (llava-v1.6's 336-pixel tiles: 1x2, 2x1, 2x2, 3x1, 1x3)
DEFAULT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def is_llava_next(config: dict[str, Any]) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def check_any_resolution(config: dict[str, Any], processor: dict[str, Any], tower: ClipTowerSpec) -> None:
    """ValueError naming the mismatch unless the processor's tiles are the tower's and both read one grid list."""
    if not tower.drop_cls:
        raise ValueError("vision_feature_select_strategy 'full': LLaVA-NeXT packs the tiles' patch grids, which "
                         "needs the CLS row dropped ('default')")
    pinpoints = config.get("image_grid_pinpoints", DEFAULT_PINPOINTS)
    theirs = processor.get("image_grid_pinpoints", DEFAULT_PINPOINTS)
    if _as_pairs(theirs) != _as_pairs(pinpoints):
        raise ValueError(f"the image processor's image_grid_pinpoints {theirs} are not config.json's {pinpoints}")
    for height, width in _as_pairs(pinpoints):
        if height % tower.image_size or width % tower.image_size:
            raise ValueError(f"image_grid_pinpoints [{height}, {width}] is not a grid of the tower's "
                             f"{tower.image_size}-pixel tiles")
    crop = processor.get("crop_size") or {}
    crop = {"height": crop, "width": crop} if isinstance(crop, int) else crop
    if (crop.get("height"), crop.get("width")) != (tower.image_size, tower.image_size):
        raise ValueError(f"the image processor's crop_size {crop} is not the vision tower's image_size "
                         f"{tower.image_size} (LLaVA-NeXT's tiles are the tower's images)")


def _as_pairs(pinpoints: Any) -> list[tuple[int, int]]:
    if not isinstance(pinpoints, list) or not pinpoints or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) and v > 0 for v in p)
            for p in pinpoints):
        raise ValueError(f"image_grid_pinpoints {pinpoints!r} must be a list of [height, width] positive integers")
    return [(int(h), int(w)) for h, w in pinpoints]


def vision_part(weights: LazyWeights) -> LazyWeights:
    """LLaVA's tower and projector weights (llava_config.vision_part) and the newline vector as ``image_newline``."""
    kept = dict(llava_config.vision_part(weights).sources())
    sources = weights.sources()
    found = [name for name in _NEWLINE_NAMES if name in sources]
    if not found:
        raise ValueError(f"a LLaVA-NeXT checkpoint without its {NEWLINE} weight")
    kept[NEWLINE] = sources[found[0]]
    return LazyWeights(kept)
