"""Images in a prompt: each image's placeholder token expanded to its run of image positions, and the
embeddings those positions take.

LLaVA-1.5's processor writes ``<image>`` once per image in the text and repeats it
``(image_size / patch_size)^2`` times (576 for the 336-pixel tower) before the model sees it; kiln does the same
on token ids, so a prompt holds exactly ``tokens_per_image`` copies of the image token per image, in order. An
``ImageSpan`` records where each image's run starts, its embeddings, and a key (from the image's content hash)
that the block manager folds into the hashes of the blocks the run touches: the same text with another image
never matches the prefix cache, the same image again does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kiln.errors import InvalidParamError

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass(frozen=True, eq=False)
class ImageSpan:
    start: int  # prompt position of the image's first token
    embeddings: npt.NDArray[np.float32]  # [tokens_per_image, hidden]
    key: int  # from the image's content hash: an int, so block hashes are the same in every process

    @property
    def end(self) -> int:
        return self.start + len(self.embeddings)


def image_hash(image: Image) -> str:
    """The content hash of a decoded image: its mode, size and pixels (not its file's bytes, so the same
    picture re-encoded as PNG or with other metadata hashes the same)."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def content_key(content_hash: str) -> int:
    """The 60-bit int a span carries for a sha256 hex digest."""
    return int(content_hash[:15], 16)


def check_placeholders(token_ids: list[int], image_token_id: int, num_images: int) -> None:
    """InvalidParamError unless the prompt holds one image placeholder per image."""
    found = sum(1 for token in token_ids if token == image_token_id)
    if found != num_images:
        raise InvalidParamError(f"the prompt has {found} image placeholder(s) but {num_images} image(s) were given; "
                                "put one image token per image in the prompt", "images")


def expand_image_tokens(token_ids: list[int], image_token_id: int, embeddings: list[npt.NDArray[np.float32]],
                        hashes: list[str]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """Each image placeholder in token_ids replaced by len(embeddings[i]) image tokens; the spans they cover.
    InvalidParamError when the placeholders and the images do not pair up."""
    check_placeholders(token_ids, image_token_id, len(embeddings))
    places = [i for i, token in enumerate(token_ids) if token == image_token_id]
    expanded: list[int] = []
    spans: list[ImageSpan] = []
    previous = 0
    for place, embedding, content in zip(places, embeddings, hashes, strict=True):
        expanded.extend(token_ids[previous:place])
        spans.append(ImageSpan(len(expanded), embedding, content_key(content)))
        expanded.extend([image_token_id] * len(embedding))
        previous = place + 1
    expanded.extend(token_ids[previous:])
    return expanded, tuple(spans)


def block_image_keys(spans: tuple[ImageSpan, ...], start: int, size: int) -> tuple[tuple[int, int], ...]:
    """(key, offset of the image's start from the block's) of each image touching positions [start, start+size)."""
    return tuple((span.key, span.start - start) for span in spans if span.start < start + size and span.end > start)


def image_rows(spans: tuple[ImageSpan, ...], start: int, count: int,
               row: int) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]]:
    """For a chunk computing positions [start, start+count) from packed row `row` on: (rows, embeddings) of each
    image part inside it."""
    parts = []
    for span in spans:
        low, high = max(span.start, start), min(span.end, start + count)
        if low < high:
            parts.append((np.arange(low - start + row, high - start + row, dtype=np.int64),
                          span.embeddings[low - span.start:high - span.start]))
    return parts
