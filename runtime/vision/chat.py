"""Chat messages with image content parts: the images taken out, each replaced in the text by the engine's image
placeholder (the image token in the family's layout: LLaVA's puts a newline after it), so any chat template
renders the conversation from plain string contents."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import InvalidParamError
from kiln.runtime.vision.images import check_image_count, check_image_size, decode_image_bytes, decode_image_url

if TYPE_CHECKING:
    from PIL.Image import Image


def split_images(messages: list[Any], placeholder: str | None,
                 media_dir: Path | None = None) -> tuple[list[Any], list[Image]]:
    """(messages with string contents, the images in order of appearance). placeholder None: a text engine,
    which refuses image parts. media_dir: where file:// image URLs may point (None: nowhere)."""
    check_image_count(sum(1 for message in messages for part in _parts(message)
                          if isinstance(part, dict) and part.get("type") in ("image_url", "image")), "messages")
    out, images = [], []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        text = []
        for p, part in enumerate(content):
            param = f"messages[{m}].content[{p}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(str(part.get("text", "")))
                continue
            if kind not in ("image_url", "image"):
                raise InvalidParamError(f"{param}: a content part of type {kind!r}; kiln takes 'text', 'image_url' "
                                        "and 'image' parts", param)
            if placeholder is None:
                raise InvalidParamError(f"{param}: this engine takes no images (it is not a vision-language engine)",
                                        param)
            images.append(_part_image(part, param, media_dir))
            text.append(placeholder)
        out.append({**message, "content": "".join(text)})
    return out, images


def _parts(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def _part_image(part: dict[str, Any], param: str, media_dir: Path | None) -> Image:
    if part["type"] == "image_url":
        url = part.get("image_url")
        return decode_image_url(url.get("url") if isinstance(url, dict) else url, f"{param}.image_url.url",
                                media_dir)
    from PIL.Image import Image as PILImage

    image = part.get("image")
    if isinstance(image, bytes):
        return decode_image_bytes(image, f"{param}.image")
    if isinstance(image, PILImage):
        check_image_size(image, f"{param}.image")
        return image
    raise InvalidParamError(f"{param}.image must be a Pillow image or an image file's bytes", f"{param}.image")
