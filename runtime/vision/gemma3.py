"""Gemma 3 images: the pixel values transformers' Gemma3ImageProcessor makes (numpy + Pillow), and the prompt
layout Gemma3Processor writes around each image.

Preprocessing, each step as transformers' PIL path computes it: to RGB (transparency composited onto white), a
resize of the whole image to the tower's ``size`` square (aspect not kept; bilinear by default) on the uint8
image, then CLIP's rescale (float64) and normalize (float32). Pan-and-scan (``do_pan_and_scan``: extra crops of
a long image) is not built; a processor config that turns it on is refused when the engine is built.

The prompt layout: the processor replaces every ``<start_of_image>`` of the text with
``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` x ``<image_soft_token>`` + ``<end_of_image>\\n\\n`` and then
tokenizes the whole text, so the newlines may merge with the text around them (Gemma's vocabulary has tokens for
runs of newlines). kiln does the same for a text prompt (``expand_text``, then the image runs found in the
token ids); a token-id prompt gets the layout on ids (``Gemma3Prompt.layout``), the newlines tokenized alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from kiln.runtime.vision.preprocess import ClipImageConfig, preprocess, to_rgb
from kiln.runtime.vision.prompt import ImageLayout

if TYPE_CHECKING:
    from PIL.Image import Image

BOI_TOKEN = "<start_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
EOI_TOKEN = "<end_of_image>"
_BILINEAR = 2


@dataclass(frozen=True)
class Gemma3ImageConfig:
    """The fields of a Gemma3ImageProcessor's preprocessor_config.json kiln reads."""

    size: int  # the tower's image_size: every image is resized to size x size
    resample: int  # Pillow's filter code: 2 is bilinear
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> Gemma3ImageConfig:
        size = data.get("size") or {}
        if not isinstance(size.get("height"), int) or size.get("height") != size.get("width") or size["height"] < 1:
            raise ValueError(f"the image processor's size {size!r} must be a square {{height, width}} (kiln resizes "
                             "every Gemma 3 image to the tower's size)")
        if data.get("do_pan_and_scan"):
            raise ValueError("the image processor has do_pan_and_scan on; kiln does not build Gemma 3's pan-and-scan")
        return cls(size=size["height"], resample=int(data.get("resample", _BILINEAR)),
                   rescale_factor=float(data.get("rescale_factor", 1 / 255)),
                   image_mean=tuple(data.get("image_mean", (0.5, 0.5, 0.5))),
                   image_std=tuple(data.get("image_std", (0.5, 0.5, 0.5))),
                   do_convert_rgb=bool(data.get("do_convert_rgb", True)), do_resize=bool(data.get("do_resize", True)),
                   do_rescale=bool(data.get("do_rescale", True)), do_normalize=bool(data.get("do_normalize", True)))

    def clip_config(self) -> ClipImageConfig:
        """The rescale and normalize, as ClipImageConfig does them (the resize is done before)."""
        return ClipImageConfig(
            shortest_edge=self.size, crop_height=self.size, crop_width=self.size, resample=self.resample,
            rescale_factor=self.rescale_factor, image_mean=self.image_mean, image_std=self.image_std,
            do_convert_rgb=False, do_resize=False, do_center_crop=False, do_rescale=self.do_rescale,
            do_normalize=self.do_normalize)


def pixel_values(image: Image, config: Gemma3ImageConfig) -> npt.NDArray[np.float32]:
    """[3, size, size] float32 pixel values of one image (see the module doc)."""
    if config.do_convert_rgb:
        image = to_rgb(image)
    if config.do_resize:
        image = image.resize((config.size, config.size), resample=config.resample)
    return preprocess(image, config.clip_config())


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class Gemma3Prompt:
    """The token ids of Gemma 3's image layout, read from the engine's tokenizer."""

    def __init__(self, tokenizer: _Tokenizer, boi_token_id: int, tokens_per_image: int) -> None:
        self.encode = tokenizer.encode
        self.boi, self.tokens_per_image = boi_token_id, tokens_per_image
        self.image, self.eoi = self._special(IMAGE_TOKEN), self._special(EOI_TOKEN)
        self.newlines = tuple(self.encode("\n\n", add_special_tokens=False))

    def _special(self, text: str) -> int:
        ids = self.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the engine's tokenizer has no {text} token (Gemma 3's image layout)")
        return ids[0]

    def layout(self) -> ImageLayout:
        """One image's tokens on ids: newlines, <start_of_image>, the image run, <end_of_image>, newlines."""
        head = (*self.newlines, self.boi)
        ids = (*head, *(self.image,) * self.tokens_per_image, self.eoi, *self.newlines)
        return ImageLayout(ids, ((len(head), self.tokens_per_image),))

    def expand_text(self, text: str) -> str:
        """text with every <start_of_image> replaced as Gemma3Processor replaces it."""
        return text.replace(BOI_TOKEN, f"\n\n{BOI_TOKEN}{IMAGE_TOKEN * self.tokens_per_image}{EOI_TOKEN}\n\n")

    def run_starts(self, ids: list[int]) -> list[int]:
        """Where each image run (tokens_per_image image tokens after <start_of_image>) starts in ids."""
        n = self.tokens_per_image
        return [i + 1 for i, token in enumerate(ids) if token == self.boi
                and ids[i + 1:i + 1 + n] == [self.image] * n]
