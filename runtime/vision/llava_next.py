"""LLaVA-NeXT (llava-v1.6) images: any-resolution tiles in numpy + Pillow (the pixel values transformers'
LlavaNextImageProcessor makes), the number of image tokens from the image's size alone (LlavaNextProcessor's), and
the packing of the tiles' features into that many rows (LlavaNextModel.pack_image_features).

Preprocessing, each step as transformers' PIL backend computes it:

1. to RGB (transparency composited onto white, as for CLIP);
2. the best grid: of ``image_grid_pinpoints`` ([height, width] pixels, multiples of the tile ``crop_size``), the
   one that keeps the most of the image's pixels once it is scaled to fit, then wastes the least;
3. the image resized (uint8, Pillow) to fit that resolution with its aspect kept (the long side's scale, the other
   side rounded up), centered on a black canvas of it, and cut into tiles row-major;
4. a base image first: the whole picture resized to the ``shortest_edge`` square, aspect not kept;
5. each of the 1 + rows x cols images through CLIP's steps (runtime/vision/preprocess.py: a resize that leaves a
   tile as it is, center crop, rescale, normalize).

Packing: the base tile's ``side x side`` rows first (``side = crop / patch``); then the grid tiles' features laid
out as one ``rows*side x cols*side`` map, the rows or columns that only saw the black padding cut off (unpadding, by
the original aspect ratio), and the learned newline vector after each remaining row of the map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kiln.runtime.vision.preprocess import ClipImageConfig, preprocess, to_rgb

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass(frozen=True)
class LlavaNextImageConfig:
    """The fields of a LlavaNextImageProcessor's preprocessor_config.json kiln reads: CLIP's per-image steps and
    the grid resolutions."""

    clip: ClipImageConfig
    grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width) in pixels

    def __post_init__(self) -> None:
        tile = self.tile_size
        if self.clip.crop_width != tile:
            raise ValueError(f"LLaVA-NeXT tiles are square: crop_size {self.clip.crop_height}x{self.clip.crop_width}")
        if not self.grid_pinpoints:
            raise ValueError("image_grid_pinpoints is empty")
        for height, width in self.grid_pinpoints:
            if height < tile or width < tile or height % tile or width % tile:
                raise ValueError(f"image_grid_pinpoints [{height}, {width}] is not a grid of {tile}-pixel tiles")

    @property
    def tile_size(self) -> int:
        return self.clip.crop_height

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> LlavaNextImageConfig:
        pinpoints = data.get("image_grid_pinpoints")
        if not isinstance(pinpoints, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pinpoints):
            raise ValueError(f"the image processor's image_grid_pinpoints {pinpoints!r} is not a list of "
                             "[height, width] pairs")
        return cls(ClipImageConfig.from_hf(data), tuple((int(h), int(w)) for h, w in pinpoints))


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """select_best_resolution: the (height, width) that keeps the most pixels of the image scaled to fit it, ties
    to the least wasted area."""
    best, most_kept, least_wasted = pinpoints[0], 0, math.inf
    for target_height, target_width in pinpoints:
        scale = min(target_width / width, target_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = target_width * target_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (target_height, target_width), kept, wasted
    return best


def grid(height: int, width: int, config: LlavaNextImageConfig) -> tuple[int, int]:
    """(rows, cols) of the tiles an image of this size is cut into (besides the base image)."""
    target_height, target_width = best_resolution(height, width, config.grid_pinpoints)
    return target_height // config.tile_size, target_width // config.tile_size


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """get_patch_output_size: the image scaled to fit target, the long side exact, the other rounded up."""
    target_height, target_width = target
    scale_width, scale_height = target_width / width, target_height / height
    if scale_width < scale_height:
        return min(math.ceil(height * scale_width), target_height), target_width
    return target_height, min(math.ceil(width * scale_height), target_width)


def tiles(image: Image, config: LlavaNextImageConfig) -> list[Image]:
    """The base image, then the grid's tiles row-major (see the module doc)."""
    from PIL import Image as PILImage

    if config.clip.do_convert_rgb:
        image = to_rgb(image)
    target = best_resolution(image.height, image.width, config.grid_pinpoints)
    height, width = fitted_size(image.height, image.width, target)
    fitted: npt.NDArray[Any] = np.asarray(image.resize((width, height), resample=config.clip.resample))
    canvas = np.zeros((target[0], target[1], *fitted.shape[2:]), dtype=fitted.dtype)
    top, left = (target[0] - height) // 2, (target[1] - width) // 2
    canvas[top:top + height, left:left + width] = fitted
    tile = config.tile_size
    cut = [PILImage.fromarray(np.ascontiguousarray(canvas[r:r + tile, c:c + tile]))
           for r in range(0, target[0], tile) for c in range(0, target[1], tile)]
    side = config.clip.shortest_edge
    return [image.resize((side, side), resample=config.clip.resample), *cut]


def pixel_values(image: Image, config: LlavaNextImageConfig) -> npt.NDArray[np.float32]:
    """[1 + rows * cols, 3, S, S] float32: the encoder inputs of one image."""
    return np.stack([preprocess(t, config.clip) for t in tiles(image, config)])


def unpadded_window(height: int, width: int, map_height: int, map_width: int) -> tuple[int, int, int, int]:
    """unpad_image: (top, bottom, left, right) of the feature map that covers the image, not the padding around
    it (the same float rounding as transformers)."""
    if width / height > map_width / map_height:
        padding = (map_height - int(round(height * (map_width / width), 7))) // 2
        return padding, map_height - padding, 0, map_width
    padding = (map_width - int(round(width * (map_height / height), 7))) // 2
    return 0, map_height, padding, map_width - padding


def num_tokens(height: int, width: int, config: LlavaNextImageConfig, tokens_per_tile: int) -> int:
    """The image tokens of an image of this size: the base tile's, then the unpadded map's rows with a newline
    each (LlavaNextProcessor._get_number_of_features, "default" strategy)."""
    side = math.isqrt(tokens_per_tile)
    rows, cols = grid(height, width, config)
    top, bottom, left, right = unpadded_window(height, width, rows * side, cols * side)
    return tokens_per_tile + (bottom - top) * (right - left + 1)


def pack(tile_embeds: npt.NDArray[np.float32], height: int, width: int, config: LlavaNextImageConfig,
         newline: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """One image's rows for the prompt: [num_tokens, hidden] from its encoder output [1 + rows * cols,
    tokens_per_tile, hidden] (base tile first)."""
    rows, cols = grid(height, width, config)
    count, per_tile, hidden = tile_embeds.shape
    side = math.isqrt(per_tile)
    if count != 1 + rows * cols or side * side != per_tile:
        raise ValueError(f"{count} tiles of {per_tile} rows for a {rows}x{cols} grid of square tiles and a base")
    feature_map = (tile_embeds[1:].reshape(rows, cols, side, side, hidden).transpose(0, 2, 1, 3, 4)
                   .reshape(rows * side, cols * side, hidden))
    top, bottom, left, right = unpadded_window(height, width, rows * side, cols * side)
    feature_map = feature_map[top:bottom, left:right]
    newlines = np.broadcast_to(newline.astype(np.float32), (feature_map.shape[0], 1, hidden))
    packed = np.concatenate([feature_map, newlines], axis=1).reshape(-1, hidden)
    return np.ascontiguousarray(np.concatenate([tile_embeds[0], packed]), dtype=np.float32)
