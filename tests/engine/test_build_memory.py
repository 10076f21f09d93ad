"""A build never holds the model's fp32 weights: `kiln build` of a 277M-parameter GGUF (Q4_K_M's mix: Q4_K, the
head and some layers' attn_v and ffn_down Q6_K) to int4-q4_1, in a child process, peaks at a fraction of the model's
fp32 size above what the child held before the build (its imports). Reading the whole model, as a build did before the
weights became lazy, costs 3-4x the fp32 size; a streamed build holds one fused matrix at a time and the quantized
engine (about a sixth of fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import load_script, write_tiny_tokenizer
from tiny_gguf import _add_tiny_gguf_tokenizer

# Of the fp32 weights' bytes, above the child's baseline: the build holds the traced graph (~150 MB), the quantized
# engine (~190 MB here) and one fused gate/up matrix in fp32 at a time (134 MB) with its quantizer's slabs: ~0.5.
BOUND = 0.75
SCALE = Path(__file__).resolve().parents[2] / "benchmarks" / "scale"

_CHILD = """
import json, resource, sys
import onnxruntime, torch  # noqa: F401  (the build's imports count in the baseline, not in the build)
import kiln.export.onnx_export, kiln.optimize.pipeline, transformers.integrations.gguf  # noqa: F401
from kiln.manifest import BuildOptions
from kiln.optimize.build import build_engine
from kiln.quant_scheme import QuantScheme

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
build_engine(sys.argv[1], sys.argv[2], BuildOptions(quantization=QuantScheme.parse("int4-q4_1")),
             progress=lambda _m: None)
print(json.dumps({"baseline_kib": before}))
"""


def test_a_build_peaks_at_a_fraction_of_the_fp32_model(tmp_path):
    checkpoints = load_script(SCALE / "checkpoints.py", "scale_checkpoints")
    # Llama-3.2-1B's layer, 4 of them, and an untied head: 277M parameters, 1.1 GB of fp32
    shape = checkpoints.Shape("llama", 2048, 4, 16, 4, 8192, tied=False, rope_theta=10000.0, vocab=8192)
    (tmp_path / "tok").mkdir()
    write_tiny_tokenizer(tmp_path / "tok")
    path = tmp_path / "random.gguf"
    params = checkpoints.write_random_gguf(shape, path, lambda w: _add_tiny_gguf_tokenizer(w, tmp_path / "tok", 8192))
    fp32 = 4 * params
    assert params > 250e6
    log = tmp_path / "child.log"
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(tmp_path / "engine")],
                                 stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage: ru_maxrss is its peak RSS
    child.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    assert child.returncode == 0, text[-3000:]
    peak = usage.ru_maxrss * 1024
    baseline = json.loads(text.strip().splitlines()[-1])["baseline_kib"] * 1024
    build = peak - baseline
    print(f"fp32 {fp32 / 2**20:.0f} MiB, child baseline {baseline / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB, "
          f"the build's own {build / 2**20:.0f} MiB ({build / fp32:.2f} of fp32)")
    assert build < BOUND * fp32, f"the build held {build / 2**20:.0f} MiB, over {BOUND} of the fp32 weights' " \
                                 f"{fp32 / 2**20:.0f} MiB"
