"""The KV pools' memory (runtime/kv_memory.py): zeroed, writable, on a 2 MiB boundary and advised into transparent
huge pages where the kernel has them; small pools are numpy's own arrays."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.kv_memory import HUGE_PAGE, HUGE_POOL_MIN, zeroed_pool


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def memory_owner(array: np.ndarray) -> object:
    """The object at the end of an array's chain of bases (a memoryview gives its exporter)."""
    owner = array
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    return owner.obj if isinstance(owner, memoryview) else owner


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
    # Just under 8 MiB: numpy's own array, not an advised mapping of ours (whose first write would make a whole
    # huge page resident). Its pages are not asserted: the kernel may merge numpy's mapping with its neighbours'.
    small = zeroed_pool((255, 2, 8, 16, 64), np.dtype(np.float16))
    assert small.flags.owndata and not small.any()
    large = zeroed_pool(SHAPE, np.dtype(np.float16))
    assert isinstance(memory_owner(large), mmap.mmap)


def test_a_pool_is_advised_into_huge_pages_where_the_kernel_has_them():
    if not THP_SETTING.is_file() or "[never]" in THP_SETTING.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    pool = zeroed_pool(SHAPE, np.dtype(np.float16))
    # "hg" is MADV_HUGEPAGE on the mapping; whether a fault then gets a huge page depends on free memory's
    # fragmentation, so the pages themselves are not asserted.
    assert "hg" in vm_flags(pool.ctypes.data) and "hg" in vm_flags(pool.ctypes.data + pool.nbytes - 1)
