"""Loading an engine costs its weights' bytes once: ONNX Runtime maps model.onnx.data, kiln.MatMulQ4_1 packs its
constant weights once at load and hands the mapped pages it read back to the OS, and the KV pool is address space
until a step writes it. So the resident memory a load adds, in a child process that has imported everything
first, stays near the engine's size; a second copy of the weights (the mapped file kept resident beside the packed
records, or initializers copied out of the map) would add the engine's size again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# ONNX Runtime's own session state (graph, kernels, allocator arenas) and the tokenizer, above the weights.
SLACK = 64 * 2**20

_CHILD = """
import json, sys
import numpy, onnxruntime, tokenizers  # noqa: F401  (imports count in the baseline, not in the load)
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig

def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}

before = rss()
engine = load_engine(sys.argv[1], RuntimeConfig(kv_cache_bytes=int(sys.argv[2]), num_threads=1))
after = rss()
print(json.dumps({"before": before, "after": after, "kv_pool": engine.runner.kv_pool_bytes}))
"""


def test_loading_an_engine_costs_its_weights_once(smollm2_q4_1_engine: Path):
    engine_bytes = sum(f.stat().st_size for f in smollm2_q4_1_engine.iterdir() if f.is_file())
    kv_bytes = 64 * 2**20  # a pool of 64 MiB: allocated, untouched until a step writes its blocks
    out = subprocess.run([sys.executable, "-c", _CHILD, str(smollm2_q4_1_engine), str(kv_bytes)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = report["before"], report["after"]
    added = after["VmRSS"] - before["VmRSS"]
    print(f"engine {engine_bytes / 2**20:.0f} MiB, KV pool {report['kv_pool'] / 2**20:.0f} MiB; the load added "
          f"{added / 2**20:.0f} MiB resident (anonymous {(after['RssAnon'] - before['RssAnon']) / 2**20:.0f}, "
          f"file-backed {(after['RssFile'] - before['RssFile']) / 2**20:.0f})")
    assert report["kv_pool"] >= kv_bytes // 2
    assert added < engine_bytes + SLACK, \
        f"loading added {added / 2**20:.0f} MiB resident for an engine of {engine_bytes / 2**20:.0f} MiB"
