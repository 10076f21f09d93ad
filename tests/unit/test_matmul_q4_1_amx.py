"""kiln.MatMulQ4_1 on AMX tiles (runtime/ops/amx_q4_1.h) against its vpdpbusd tile, bit for bit.

The tile unit computes each block's int32 dots exactly and the float epilogue is the vpdpbusd tile's, term for
term, so the outputs must be equal bits: calls of 32 rows and more (the AMX path's threshold) across ragged row
counts (rows padded to whole tiles of 16), ragged channel counts (a last group of 16 part padding, a work item with
one group), both weight layouts, a bias, the Q4_0 centre, and one or two threads. The library decides once per
process whether the tiles may be used, so each path runs in its own interpreter, chosen with KILN_OPS_ISA; each
reports how many calls took the tiles (kiln_amx_multiplies), so the comparison cannot pass with AMX unused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime import ops

# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked in a child process: 0 where Linux grants the tiles
GRANT = "import ctypes; print(ctypes.CDLL(None).syscall(158, 0x1023, 18))"


def linux_grants_tiles() -> bool:
    done = subprocess.run([sys.executable, "-c", GRANT], capture_output=True, text=True, timeout=60)
    return done.returncode == 0 and done.stdout.strip() == "0"


HAS_AMX = "amx" in ops.supported_variants(ops.cpu_flags())
pytestmark = [
    pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-INT8 (Intel Sapphire Rapids or later)"),
    # asked only where the CPU has AMX: elsewhere no child process at collection
    pytest.mark.skipif(HAS_AMX and not linux_grants_tiles(),
                       reason="Linux does not grant this process AMX's tile data (arch_prctl)"),
]

# (rows, K, N, layout, bias, centre, threads)
CASES = [
    (32, 576, 100, "records", True, None, 2),
    (33, 576, 100, "blocks", False, None, 1),
    (47, 1536, 96, "records", True, 8.0, 2),
    (64, 576, 80, "records", False, None, 2),  # 5 groups: a work item of 4 and one of 1
    (100, 576, 48, "records", True, None, 1),
    (200, 1536, 576, "records", True, None, 2),
    (31, 576, 100, "records", True, None, 2),  # below the threshold: both processes run the vpdpbusd tile
]

RUN = r"""
import ctypes, json, sys
import numpy as np, onnxruntime as ort
from kiln.matmul_q4_1 import make_single_op_model
from kiln.optimize.quant.rtn import quantize_q4_1
from kiln.runtime import ops

rows, k, n, layout, bias, centre, threads = json.loads(sys.argv[1])
rng = np.random.default_rng(rows * 7 + n)
x = rng.standard_normal((rows, k)).astype(np.float32)
x[:, 5] *= 30  # an outlier: int8 activations at full range
weights = quantize_q4_1((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
model = make_single_op_model(weights, bias=rng.standard_normal(n).astype(np.float32) if bias else None,
                             layout=layout, centre=centre)
so = ort.SessionOptions()
so.register_custom_ops_library(ops.library_path())
so.intra_op_num_threads = threads
y = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
np.save(sys.argv[2], y)
print(ctypes.CDLL(ops.library_path()).kiln_amx_multiplies())
"""


def run(path: str, case: tuple, out: Path) -> tuple[np.ndarray, int]:
    env = {**os.environ, ops.ISA_ENV: path}
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(case), str(out)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return np.load(out), int(done.stdout.split()[-1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-N{c[2]}-{c[3]}-t{c[6]}")
def test_the_tiles_give_the_vpdpbusd_tiles_bits(case, tmp_path):
    amx, amx_calls = run("amx", case, tmp_path / "amx.npy")
    vnni, vnni_calls = run("avx512vnni", case, tmp_path / "vnni.npy")
    assert vnni_calls == 0  # KILN_OPS_ISA=avx512vnni keeps the library off the tiles
    assert amx_calls == (1 if case[0] >= 32 else 0)
    np.testing.assert_array_equal(amx, vnni)
