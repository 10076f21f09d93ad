"""The KV pools' memory: zeroed private anonymous mappings on 2 MiB boundaries, advised into transparent huge pages.

A decode step at long context reads every cached block of every layer, each (block, KV head) tile a few KB at a
place the block table chooses, so the pools' pages decide how often a tile costs a page walk. numpy advises its
large arrays into huge pages too, and most of their pages were huge, yet a mapping of our own measured faster: the
1B shape's 32k-context decode step grew 0.84x as much over 1k (median of 8 pairs), one layer's attention took
0.80-0.84x the time at 32k and 0.90-0.94x at 8k (benchmarks/RESULTS.md, "KV pools in huge pages"). The mapping is
private because shared anonymous memory follows the shmem huge-page setting, usually off. Where the kernel has no
transparent huge pages the advice is refused and the pools are ordinary zeroed memory.

A pool below HUGE_POOL_MIN stays numpy's zeroed array: a huge page is also the unit in which an untouched pool
becomes resident (a step writing one block of every layer makes 2 MiB a layer resident, not 4 KiB), a quarter or
more of a pool that small. Default pools (a tenth of the memory) are far larger.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

HUGE_PAGE = 2 << 20
HUGE_POOL_MIN = 8 << 20  # a layer's pool from which its pages are huge


def zeroed_pool(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed array of `shape` and `dtype`: from HUGE_POOL_MIN bytes on, starting on a 2 MiB boundary of a private
    anonymous mapping advised MADV_HUGEPAGE (the array keeps the mapping alive)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < HUGE_POOL_MIN:
        return np.zeros(shape, dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mapping, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None:
        try:
            mapping.madvise(advise, start, nbytes)
        except OSError:  # no transparent huge pages here: ordinary pages, the same zeroed memory
            pass
    return raw[start:start + nbytes].view(dtype).reshape(shape)
