"""A process's resident memory, and an enforced cap on how much more memory it may take (a pipeline stage's).

The cap is RLIMIT_DATA, set relative to what the process has already mapped: since Linux 4.7 the kernel counts
every private writable mapping (malloc's heap and its mmap'd chunks, thread stacks) against it and refuses the
brk/mmap past it, so a session whose weights do not fit fails its allocation (onnxruntime raises, Python raises
MemoryError) instead of growing. Ray's `memory=` resource only steers scheduling; it limits nothing.
"""

from __future__ import annotations

import os
import re
import resource


def _status_bytes(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmData) in bytes."""
    with open("/proc/self/status") as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M)
    if found is None:
        raise OSError(f"/proc/self/status has no {field}")
    return int(found.group(1)) * 1024


def resident_bytes() -> int:
    """This process's resident memory now."""
    return _status_bytes("VmRSS")


def limit_memory_growth(budget_bytes: int) -> int:
    """Cap this process's private writable memory at what it maps now plus budget_bytes (the soft RLIMIT_DATA;
    the process keeps its hard limit). Returns the cap, in bytes."""
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
    cap = _status_bytes("VmData") + budget_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY and cap > hard:
        raise ValueError(f"a cap of {cap} bytes is above this process's hard RLIMIT_DATA ({hard}, pid {os.getpid()})")
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    return cap
