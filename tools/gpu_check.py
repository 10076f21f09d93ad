"""`make gpu-check`: the GPU checks on a CUDA machine that has only this repository (no network, no weights).

It needs python3 with torch (CUDA), triton 3.6, numpy and pytest already installed, as on the GPU image, and
installs nothing: kiln is put on PYTHONPATH as a symlink tree of its installed layout (tools/typecheck.py's
mirror). Then it runs tests/gpu (the compiled Triton kernels against the reference, and the PTX compile for
this GPU) and benchmarks/gpu_paged_attention.py (the decode bandwidth table, also written to
gpu-bandwidth.json). A few minutes on an H100/H200.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from typecheck import REPO, mirror_packages  # noqa: E402

TREE = REPO / ".cache" / "gpu-check"


def main() -> int:
    mirror_packages(TREE)
    # -P: `python -m` would put the repository root first on sys.path, where the source folder kiln/ (without
    # the subpackages the mirror maps in) would shadow the mirrored package.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TREE), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    env["KILN_GPU_CHECK"] = "1"  # tests/conftest.py then leaves Triton compiling, not interpreting
    steps = [
        [sys.executable, "-P", "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "tests/gpu"],
        [sys.executable, "-P", "benchmarks/gpu_paged_attention.py", "--json", "gpu-bandwidth.json"],
    ]
    for command in steps:
        print("+", " ".join(command), flush=True)
        code = subprocess.call(command, cwd=REPO, env=env)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
