"""The KV pools' memory (runtime/kv_memory.py): zeroed, writable, on a 2 MiB boundary, and in transparent huge
pages where the kernel offers them to advised mappings; small pools on ordinary pages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.kv_memory import HUGE_PAGE, HUGE_POOL_MIN, zeroed_pool


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SHAPE = (257, 2, 8, 16, 64)  # float16: a little over 8 MiB, the last huge page partly used


def test_a_pool_is_zeroed_writable_contiguous_and_2_mib_aligned():
    pool = zeroed_pool(SHAPE, np.dtype(np.float16))
    assert pool.nbytes >= HUGE_POOL_MIN and pool.shape == SHAPE and pool.dtype == np.float16
    assert pool.flags.c_contiguous and pool.flags.writeable and pool.ctypes.data % HUGE_PAGE == 0
    assert not pool.any()
    pool[-1, 1, 7, 15, 63] = 1.5  # the last element is inside the mapping
    assert pool.sum() == 1.5


def test_a_pool_below_the_huge_pool_size_is_ordinary_zeroed_memory():
    pool = zeroed_pool((4, 2, 2, 16, 8), np.dtype(np.float32))
    assert pool.shape == (4, 2, 2, 16, 8) and not pool.any() and pool.flags.writeable
    small = zeroed_pool((255, 2, 8, 16, 64), np.dtype(np.float16))  # just under 8 MiB
    small[0, 0, 0, 0, 0] = 1  # one block written
    if THP_SETTING.is_file() and "[madvise]" in THP_SETTING.read_text():  # huge pages only where asked for
        assert anon_huge_kib(small.ctypes.data) == 0


def test_a_pool_is_in_huge_pages_where_advised_mappings_get_them():
    if not THP_SETTING.is_file() or "[never]" in THP_SETTING.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    pool = zeroed_pool(SHAPE, np.dtype(np.float16))
    pool[:, :, :, :, 0] = 1  # touched: the pages exist
    assert anon_huge_kib(pool.ctypes.data) >= HUGE_POOL_MIN // 1024
