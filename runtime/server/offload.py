"""The server's worker pool: CPU work a request needs around the engine (parsing a large JSON body,
rendering a chat template, tokenizing and detokenizing long texts) runs here, off the event loop, so
one request's cost never becomes every other request's latency.

Small work stays on the event loop (``run_sized``): a 100-byte body decodes in ~15 us and a
sentence tokenizes in ~40 us, while a trip through a worker costs two thread wake-ups and two GIL
hand-overs (each up to the 5 ms switch interval while the engine thread runs Python), and under
load those, not the work, were most of a short request's latency. What counts as small is set per
kind of work from its cost, so inline work never holds the loop for more than ~0.5 ms.

Bounded: half the cores at most (the engine thread and its onnxruntime threads need the cores more),
and what waits for a thread is bounded by the request-size limit times the connection limit.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# The most of each kind of work done on the event loop (each ~0.5 ms at most on a Zen 3 core).
INLINE_BODY_BYTES = 16 << 10  # JSON decoding and validation: ~15 ns a byte
INLINE_TEMPLATE_BYTES = 8 << 10  # chat template rendering, by the request body's size
INLINE_TOKENIZE_CHARS = 256  # tokenizing (with the request's checks): ~1-2 us a character
INLINE_TOKEN_IDS = 2048  # detokenizing, or each id's string: ~0.1 us an id


def default_workers() -> int:
    """Half the cores, 1 to 4: the work here releases the GIL where it is long (tokenizing), so each thread can
    take a core; half are left to the engine thread and the event loop whatever the requests ask."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


class Offload:
    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kiln-http")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on a worker thread; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def run_sized(self, size: int, limit: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) here on the event loop when its work (``size``) is at most ``limit``, else on a
        worker thread."""
        if size <= limit:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
