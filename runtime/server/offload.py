"""The server's worker pool: CPU work a request needs around the engine (parsing a large JSON body,
rendering a chat template, tokenizing and detokenizing long texts) runs here, off the event loop, so
one request's cost never becomes every other request's latency.

Bounded: a few threads (the engine thread and its onnxruntime threads need the cores more), and
what waits for a thread is bounded by the request-size limit times the connection limit.
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


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class Offload:
    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kiln-http")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on a worker thread; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
