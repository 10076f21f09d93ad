"""CLIP image preprocessing in numpy + Pillow: the pixel values transformers' CLIPImageProcessor makes.

LLaVA-1.5 feeds its CLIP tower one square crop per image, computed in this order (each step as
transformers' PIL backend computes it, so the result is equal to float32 rounding, not merely close):

1. to RGB: an image with an alpha band (or a palette transparency) is composited onto white, any other mode
   converted by Pillow (L, P, CMYK, ...);
2. resize so the shortest edge is ``shortest_edge`` (the long edge ``int(size * long / short)``, truncated),
   with Pillow's resampling filter (bicubic for CLIP) on the uint8 image;
3. center crop to ``crop_size`` (top/left ``(size - crop) // 2``; an image smaller than the crop is padded with
   zeros around it first);
4. rescale by ``rescale_factor`` (1/255) in float64, then float32;
5. normalize ``(x - mean) / std`` per channel in float32;

giving pixel values [3, crop_height, crop_width] float32, channels first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass(frozen=True)
class ClipImageConfig:
    """The fields of a CLIPImageProcessor's preprocessor_config.json kiln reads (each step can be off)."""

    shortest_edge: int
    crop_height: int
    crop_width: int
    resample: int  # Pillow's filter code: 3 is bicubic
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    def __post_init__(self) -> None:
        for name in ("shortest_edge", "crop_height", "crop_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"image preprocessing {name} must be a positive integer, got {value!r}")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"image preprocessing {name} must have 3 values (RGB), got {getattr(self, name)!r}")
        if any(s <= 0 for s in self.image_std):
            raise ValueError(f"image preprocessing image_std must be positive, got {self.image_std!r}")

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> ClipImageConfig:
        """From a preprocessor_config.json of CLIPImageProcessor (size {"shortest_edge"}, crop_size {h, w})."""
        size, crop = data.get("size") or {}, data.get("crop_size") or {}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if "shortest_edge" not in size:
            raise ValueError(f"the image processor's size {size!r} has no shortest_edge (kiln reads CLIP's "
                             "shortest-edge resize)")
        return cls(
            shortest_edge=size["shortest_edge"], crop_height=crop.get("height", size["shortest_edge"]),
            crop_width=crop.get("width", size["shortest_edge"]), resample=int(data.get("resample", 3)),
            rescale_factor=float(data.get("rescale_factor", 1 / 255)),
            image_mean=tuple(data["image_mean"]), image_std=tuple(data["image_std"]),
            do_convert_rgb=bool(data.get("do_convert_rgb", True)), do_resize=bool(data.get("do_resize", True)),
            do_center_crop=bool(data.get("do_center_crop", True)), do_rescale=bool(data.get("do_rescale", True)),
            do_normalize=bool(data.get("do_normalize", True)),
        )

    def to_dict(self) -> dict[str, Any]:
        """The preprocessor_config.json keys from_hf reads."""
        return {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": self.shortest_edge},
                "crop_size": {"height": self.crop_height, "width": self.crop_width}, "resample": self.resample,
                "rescale_factor": self.rescale_factor, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std), "do_convert_rgb": self.do_convert_rgb,
                "do_resize": self.do_resize, "do_center_crop": self.do_center_crop, "do_rescale": self.do_rescale,
                "do_normalize": self.do_normalize}


def to_rgb(image: Image) -> Image:
    """RGB, with any transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image as PILImage

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) with the short side at shortest_edge and the long one scaled, truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (new_long, shortest_edge) if width <= height else (shortest_edge, new_long)


def center_crop(pixels: npt.NDArray[Any], height: int, width: int) -> npt.NDArray[Any]:
    """The centered [height, width] window of an [H, W, C] array, zero-padded around a smaller image."""
    rows, cols = pixels.shape[:2]
    top, left = (rows - height) // 2, (cols - width) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + height, left:left + width]
    padded = np.zeros((max(rows, height), max(cols, width), *pixels.shape[2:]), dtype=pixels.dtype)
    pad_top, pad_left = math.ceil((padded.shape[0] - rows) / 2), math.ceil((padded.shape[1] - cols) / 2)
    padded[pad_top:pad_top + rows, pad_left:pad_left + cols] = pixels
    return center_crop(padded, height, width)


def preprocess(image: Image, config: ClipImageConfig) -> npt.NDArray[np.float32]:
    """Pixel values [3, crop_height, crop_width] float32 of one image (see the module doc)."""
    if config.do_convert_rgb:
        image = to_rgb(image)
    if config.do_resize:
        height, width = shortest_edge_size(image.height, image.width, config.shortest_edge)
        image = image.resize((width, height), resample=config.resample)
    pixels: npt.NDArray[Any] = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if config.do_center_crop:
        pixels = center_crop(pixels, config.crop_height, config.crop_width)
    if config.do_rescale:
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    if config.do_normalize:
        mean = np.array(config.image_mean, dtype=np.float32)
        std = np.array(config.image_std, dtype=np.float32)
        pixels = (pixels.astype(np.float32) - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)
