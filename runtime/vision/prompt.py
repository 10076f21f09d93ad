"""Images in a prompt: each image's placeholder token expanded to its run of image positions, and the
embeddings those positions take.

A prompt holds one image token per image; kiln expands each, on token ids, the way the family's processor
expands it in text (an ``ImageLayout``): LLaVA-1.5 repeats ``<image>`` ``(image_size / patch_size)^2`` times
(576 for the 336-pixel tower); Idefics3 / SmolVLM write one run of image tokens per tile, among tile-marker
tokens (runtime/vision/idefics3.py). An ``ImageSpan`` records where one run starts, its embeddings, and a key
(from the image's content hash) that the block manager folds into the hashes of the blocks the run touches: the
same text with another image never matches the prefix cache, the same image again does.
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
    # the run's tokens see each other (Gemma 3): the scheduler computes the whole run in one step
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.embeddings)


@dataclass(frozen=True)
class ImageLayout:
    """The tokens one image placeholder expands to, and the runs in them that take the image's embeddings:
    (offset in token_ids, rows), in the order of the encoder's rows."""

    token_ids: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]

    @classmethod
    def one_run(cls, image_token_id: int, rows: int) -> ImageLayout:
        """LLaVA's: the image token repeated once per embedding row."""
        return cls((image_token_id,) * rows, ((0, rows),))


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
                        hashes: list[str], layouts: list[ImageLayout] | None = None,
                        ) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """Each image placeholder in token_ids replaced by its layout's tokens (default: len(embeddings[i]) image
    tokens); the spans of the runs that take embeddings. InvalidParamError when the placeholders and the images
    do not pair up."""
    check_placeholders(token_ids, image_token_id, len(embeddings))
    if layouts is None:
        layouts = [ImageLayout.one_run(image_token_id, len(embedding)) for embedding in embeddings]
    places = [i for i, token in enumerate(token_ids) if token == image_token_id]
    expanded: list[int] = []
    spans: list[ImageSpan] = []
    previous = 0
    for place, embedding, content, layout in zip(places, embeddings, hashes, layouts, strict=True):
        expanded.extend(token_ids[previous:place])
        if sum(rows for _, rows in layout.runs) != len(embedding):
            raise ValueError(f"an image layout of {layout.runs} runs for {len(embedding)} embedding rows")
        row = 0
        for offset, rows in layout.runs:
            spans.append(ImageSpan(len(expanded) + offset, embedding[row:row + rows], content_key(content)))
            row += rows
        expanded.extend(layout.token_ids)
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


def runs_at(starts: list[int], embeddings: list[npt.NDArray[np.float32]], hashes: list[str],
            bidirectional: bool) -> tuple[ImageSpan, ...]:
    """One span per image, its run starting at starts[i] (a prompt whose layout was written in text)."""
    if len(starts) != len(embeddings):
        raise InvalidParamError(f"the prompt has {len(starts)} image run(s) but {len(embeddings)} image(s) were "
                                "given", "images")
    return tuple(ImageSpan(start, embedding, content_key(content), bidirectional)
                 for start, embedding, content in zip(starts, embeddings, hashes, strict=True))


def attend_until(spans: tuple[ImageSpan, ...], start: int, count: int) -> npt.NDArray[np.int32] | None:
    """For a chunk computing positions [start, start+count): the last position each of its tokens sees (its own,
    or the end of its bidirectional image run); None when no bidirectional run is in it."""
    runs = [span for span in spans if span.bidirectional and span.start < start + count and span.end > start]
    if not runs:
        return None
    until = np.arange(start, start + count, dtype=np.int32)
    for span in runs:
        if span.end > start + count:
            raise ValueError(f"a chunk ending at {start + count} cuts the bidirectional image run "
                             f"[{span.start}, {span.end})")
        until[max(span.start, start) - start:span.end - start] = span.end - 1
    return until
