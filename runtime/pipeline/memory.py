"""A process's resident memory, and an enforced cap on how much more memory it may take (a pipeline stage's).

The cap is RLIMIT_DATA, set relative to what the process has already mapped: since Linux 4.7 the kernel counts
every private writable mapping (malloc's heap and its mmap'd chunks, thread stacks) against it and refuses the
brk/mmap past it, so a session whose weights do not fit fails its allocation (onnxruntime raises, Python raises
MemoryError) instead of growing. Ray's `memory=` resource only steers scheduling; it limits nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
from pathlib import Path

from kiln.manifest import EngineLoadError


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


def probe_load(graph: Path, budget_bytes: int | None, num_threads: int = 1) -> dict[str, object]:
    """Open graph's session in this process under limit_memory_growth(budget_bytes) (None: no cap): whether it
    loaded, the error if not, and the private memory and resident memory the load added."""
    from kiln.runtime.ort_runner import open_session

    if budget_bytes is not None:
        limit_memory_growth(budget_bytes)
    data, resident = _status_bytes("VmData"), resident_bytes()
    try:
        session = open_session(graph, num_threads)
    except (MemoryError, EngineLoadError) as exc:
        return {"graph": graph.name, "budget_bytes": budget_bytes, "loaded": False, "error": str(exc)[:300]}
    grew = {"data_bytes": _status_bytes("VmData") - data, "resident_bytes": resident_bytes() - resident}
    del session
    return {"graph": graph.name, "budget_bytes": budget_bytes, "loaded": True, **grew}


def main() -> None:
    """python -m kiln.runtime.pipeline.memory GRAPH [--budget-bytes N]: does GRAPH (an engine's model.onnx or a
    stage's stageK.onnx) load in a process allowed N more bytes (what --stage-memory-bytes N gives a stage)? One
    JSON line; exit status 1 if it did not."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("graph", type=Path)
    parser.add_argument("--budget-bytes", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args()
    result = probe_load(args.graph, args.budget_bytes, args.num_threads)
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["loaded"] else 1)


if __name__ == "__main__":
    main()
