"""Idefics3 / SmolVLM images: tiles in numpy + Pillow (the pixel values transformers' Idefics3ImageProcessor and
SmolVLMImageProcessor make), and the prompt layout their processors write around each image.

Preprocessing, each step as transformers' PIL backend computes it (uint8 resizes chained in Pillow):

1. to RGB (transparency composited onto white, as for CLIP);
2. resize so the longest edge is ``size.longest_edge`` (the other edge ``int(edge / aspect)``, rounded up to even),
   then shrunk below 4096 pixels if needed;
3. with ``do_image_splitting``: resize up to multiples of the tile size ``max_image_size.longest_edge`` and,
   when that is more than one tile, cut it into rows x cols tiles (row-major) plus a global image (the whole,
   resized to one tile); else (or without splitting) one tile, the image resized to the tile size;
4. rescale and normalize per channel, as CLIP's.

Every tile is a full ``S x S`` image, so the encoder sees no padding. The prompt layout: a placeholder ``<image>``
becomes, for a split image, per row ``(<fake_token_around_image> <row_r_col_c> <image> * seq) * cols`` then
``\\n``; after the last row another ``\\n``, then ``<fake_token_around_image> <global-img> <image> * seq
<fake_token_around_image>`` (a single tile: that last part only). Each ``<image>`` run takes one tile's
embeddings, in the order the tiles were cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from kiln.runtime.vision.preprocess import ClipImageConfig, preprocess, to_rgb
from kiln.runtime.vision.prompt import ImageLayout

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_IMAGE_SIZE = 4096  # transformers' Idefics3 absolute limit on a resized image's side
_LANCZOS = 1


@dataclass(frozen=True)
class Idefics3ImageConfig:
    """The fields of an Idefics3ImageProcessor's preprocessor_config.json kiln reads."""

    longest_edge: int  # size.longest_edge: the first resize
    tile_size: int  # max_image_size.longest_edge: one encoder image
    resample: int  # Pillow's filter code: 1 is Lanczos
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    def __post_init__(self) -> None:
        for name in ("longest_edge", "tile_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"image preprocessing {name} must be a positive integer, got {value!r}")

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> Idefics3ImageConfig:
        size, tile = data.get("size") or {}, data.get("max_image_size") or {}
        if "longest_edge" not in size or "longest_edge" not in tile:
            raise ValueError(f"the image processor's size {size!r} and max_image_size {tile!r} need a longest_edge "
                             "(kiln reads Idefics3's longest-edge resize)")
        return cls(
            longest_edge=size["longest_edge"], tile_size=tile["longest_edge"],
            resample=int(data.get("resample", _LANCZOS)), rescale_factor=float(data.get("rescale_factor", 1 / 255)),
            image_mean=tuple(data.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(data.get("image_std", (0.5, 0.5, 0.5))),
            do_convert_rgb=bool(data.get("do_convert_rgb", True)), do_resize=bool(data.get("do_resize", True)),
            do_image_splitting=bool(data.get("do_image_splitting", True)),
            do_rescale=bool(data.get("do_rescale", True)), do_normalize=bool(data.get("do_normalize", True)),
        )

    def tile_config(self) -> ClipImageConfig:
        """The per-tile rescale and normalize, as ClipImageConfig does them (no resize or crop: tiles are cut)."""
        return ClipImageConfig(
            shortest_edge=self.tile_size, crop_height=self.tile_size, crop_width=self.tile_size,
            resample=self.resample, rescale_factor=self.rescale_factor, image_mean=self.image_mean,
            image_std=self.image_std, do_convert_rgb=False, do_resize=False, do_center_crop=False,
            do_rescale=self.do_rescale, do_normalize=self.do_normalize)


def longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """Idefics3's first resize: the long side at longest_edge, the other scaled, truncated and rounded up to even,
    then both shrunk below MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest_edge, int(longest_edge / aspect)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """resize_for_vision_encoder: the long side rounded up to a multiple of tile, the other scaled, then rounded
    up too."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def grid(height: int, width: int, config: Idefics3ImageConfig) -> tuple[int, int]:
    """(rows, cols) of the tiles an image of this size is cut into; (0, 0) for one unsplit tile."""
    if config.do_resize:
        height, width = longest_edge_size(height, width, config.longest_edge)
    if not config.do_image_splitting:
        return 0, 0
    height, width = tile_multiple_size(height, width, config.tile_size)
    if height <= config.tile_size and width <= config.tile_size:
        return 0, 0
    return height // config.tile_size, width // config.tile_size


def tiles(image: Image, config: Idefics3ImageConfig) -> tuple[list[Image], int, int]:
    """(the tile images in encoder order, rows, cols); rows = cols = 0 for one unsplit tile."""
    rows, cols = grid(image.height, image.width, config)  # what the prompt layout is built from
    if config.do_convert_rgb:
        image = to_rgb(image)
    if config.do_resize:
        height, width = longest_edge_size(image.height, image.width, config.longest_edge)
        image = image.resize((width, height), resample=config.resample)
    tile = config.tile_size
    if not config.do_image_splitting:
        return [image.resize((tile, tile), resample=config.resample)], 0, 0
    height, width = tile_multiple_size(image.height, image.width, tile)
    image = image.resize((width, height), resample=config.resample)
    if rows == 0:
        return [image], 0, 0
    cut = [image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)]
    return [*cut, image.resize((tile, tile), resample=config.resample)], rows, cols


def pixel_values(image: Image, config: Idefics3ImageConfig) -> tuple[npt.NDArray[np.float32], int, int]:
    """(pixel values [tiles, 3, S, S] float32, rows, cols) of one image."""
    cut, rows, cols = tiles(image, config)
    per_tile = config.tile_config()
    return np.stack([preprocess(t, per_tile) for t in cut]), rows, cols


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class Idefics3Prompt:
    """The token ids of the processor's image layout, read from the engine's tokenizer once."""

    def __init__(self, tokenizer: _Tokenizer, image_token_id: int, tokens_per_tile: int) -> None:
        self.image_token_id, self.tokens_per_tile = image_token_id, tokens_per_tile
        self.encode = tokenizer.encode
        self.fake = self._special("<fake_token_around_image>")
        self.global_image = self._special("<global-img>")
        self.newline = self.encode("\n", add_special_tokens=False)
        self.two_newlines = self.encode("\n\n", add_special_tokens=False)

    def _special(self, text: str) -> int:
        ids = self.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the engine's tokenizer has no {text} token (an Idefics3 / SmolVLM tokenizer adds it)")
        return ids[0]

    def layout(self, rows: int, cols: int) -> ImageLayout:
        seq = [self.image_token_id] * self.tokens_per_tile
        ids: list[int] = []
        runs: list[tuple[int, int]] = []
        for r in range(rows):
            for c in range(cols):
                ids += [self.fake, self._special(f"<row_{r + 1}_col_{c + 1}>")]
                runs.append((len(ids), self.tokens_per_tile))
                ids += seq
            ids += self.newline if r < rows - 1 else self.two_newlines
        ids += [self.fake, self.global_image]
        runs.append((len(ids), self.tokens_per_tile))
        ids += [*seq, self.fake]
        return ImageLayout(tuple(ids), tuple(runs))
