"""Progress bars for the build stages' long loops: tqdm on stderr (TQDM_DISABLE=1 turns them off).

Each stage counts its own units: the exporter the decoder layers it traces and then its own
phases, calibration its windows, searched groups, clipped linears and tuning steps, each
quantization pass its linears, the engine writer its tensors. The bars are transient (leave=False):
the stage's messages ("export onnx done in 41.2s") are what stays in the log.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def print_above_bars(message: str) -> None:
    """A stage message on stderr that an active bar neither garbles nor overwrites (the bar is redrawn below)."""
    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


def progress_bar(description: str, total: int | None = None, unit: str = "step") -> tqdm:
    """A bar to update() by hand (use it as a context manager, or close() it)."""
    return tqdm(total=total, desc=description, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)


def track(items: Iterable[T], description: str, unit: str = "step", total: int | None = None) -> Iterator[T]:
    """items, advancing a bar as each one is taken."""
    with progress_bar(description, total if total is not None else _length(items), unit) as bar:
        for item in items:
            yield item
            bar.update(1)


def _length(items: Iterable[object]) -> int | None:
    return len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
