"""Image content parts of chat messages, taken out before the chat template renders the conversation.

Each ``image_url`` part is decoded (runtime/vision/images.py: data URLs, and file URLs inside the directory
``--allowed-media-path`` allows; size and count limits, every refusal a 400 naming the part) and replaced by a
text part holding the engine's image placeholder in its family's layout (LLaVA's: the image token and a newline;
SmolVLM's: the token alone); the engine expands each placeholder to the image's tokens.
A text-only engine refuses image parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import InvalidParamError
from kiln.runtime.server.protocol import ChatMessage, ImageUrlPart, TextPart
from kiln.runtime.vision.images import check_image_count, decode_image_url
from kiln.runtime.vision.local_media import is_file_url

if TYPE_CHECKING:
    from PIL.Image import Image


def _image_parts(messages: Sequence[Any]) -> list[tuple[int, int]]:
    return [(m, p) for m, message in enumerate(messages) if isinstance(message, ChatMessage)
            and isinstance(message.content, list)
            for p, part in enumerate(message.content) if isinstance(part, ImageUrlPart)]


def names_files(messages: Sequence[Any]) -> bool:
    """Whether an image part is a file URL: reading and decoding it is work the request's size does not show."""
    return any(is_file_url(messages[m].content[p].image_url.url) for m, p in _image_parts(messages))


def take_images(messages: Sequence[Any], placeholder: str | None,
                media_dir: Path | None = None) -> tuple[list[Any], list[Image]]:
    """(the messages with each image part replaced by the placeholder, the decoded images in order); file URLs
    read inside media_dir (None: refused)."""
    parts = _image_parts(messages)
    if not parts:
        return list(messages), []
    if placeholder is None:
        m, p = parts[0]
        raise InvalidParamError(f"messages[{m}].content[{p}]: this model takes no images (it is not a "
                                "vision-language engine)", f"messages.{m}.content.{p}")
    check_image_count(len(parts), "messages")
    images = []
    out = list(messages)
    for m, p in parts:
        part = messages[m].content[p]
        images.append(decode_image_url(part.image_url.url, f"messages.{m}.content.{p}.image_url.url", media_dir))
    for m in sorted({m for m, _ in parts}):
        content = [TextPart(type="text", text=placeholder) if isinstance(part, ImageUrlPart) else part
                   for part in messages[m].content]
        out[m] = messages[m].model_copy(update={"content": content})
    return out, images
