"""Loading an engine costs its weights' bytes once, and kiln.MatMulQ4_1's weights cost no memory of their own: ONNX
Runtime maps model.onnx.data, the op reads the records stored there in place, and the KV pool is address space until
a step writes it. So in a child process that has imported everything first, the resident memory that a load and one
step add stays near the engine's size, and the Q4_1 records are file-backed pages (the page cache, shared with any
other process serving the engine), not anonymous memory: an op that copied or packed them would add them as
anonymous memory and leave the file's pages out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
from q4_1_records_helpers import q4_1_nodes

# Above the weights: ONNX Runtime's session state (graph, kernels, allocator arenas, and the 27 MiB int8 head its
# MatMulNBits packs, a copy), the tokenizer, a step's activations, and the file's pages the kernel maps around those a
# step reads (fault-around). A second copy of the Q4_1 records (63 MiB) does not fit in it.
SLACK = 96 * 2**20
# Of that, anonymous: the session state, the packed head, the tokenizer and the activations (not the file's pages).
ANONYMOUS_SLACK = 64 * 2**20

_CHILD = """
import json, sys
import numpy, onnxruntime, tokenizers  # noqa: F401  (imports count in the baseline, not in the load)
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig, SamplingParams

def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}

before = rss()
engine = load_engine(sys.argv[1], RuntimeConfig(kv_cache_bytes=int(sys.argv[2]), num_threads=1))
engine.add_request("0", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=2))
while engine.has_unfinished():
    engine.step()  # every weight read once
after = rss()
print(json.dumps({"before": before, "after": after, "kv_pool": engine.runner.kv_pool_bytes}))
"""


def records_bytes(engine: Path) -> int:
    """The bytes of the engine's kiln.MatMulQ4_1 records (their external tensors' lengths)."""
    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False).graph
    lengths = {t.name: int(next(e.value for e in t.external_data if e.key == "length"))
               for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    return sum(lengths[name] for name in {n.input[1] for n in q4_1_nodes(graph)})


def test_loading_an_engine_maps_its_weights_once(smollm2_q4_1_engine: Path):
    engine_bytes = sum(f.stat().st_size for f in smollm2_q4_1_engine.iterdir() if f.is_file())
    q4_1_bytes = records_bytes(smollm2_q4_1_engine)
    kv_bytes = 64 * 2**20  # a pool of 64 MiB: allocated, untouched until a step writes its blocks
    out = subprocess.run([sys.executable, "-c", _CHILD, str(smollm2_q4_1_engine), str(kv_bytes)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = report["before"], report["after"]
    added, anonymous, mapped = (after[k] - before[k] for k in ("VmRSS", "RssAnon", "RssFile"))
    print(f"engine {engine_bytes / 2**20:.0f} MiB (Q4_1 records {q4_1_bytes / 2**20:.0f}), KV pool "
          f"{report['kv_pool'] / 2**20:.0f} MiB; a load and a step added {added / 2**20:.0f} MiB resident (anonymous "
          f"{anonymous / 2**20:.0f}, file-backed {mapped / 2**20:.0f})")
    assert report["kv_pool"] >= kv_bytes // 2
    assert added < engine_bytes + SLACK, \
        f"loading added {added / 2**20:.0f} MiB resident for an engine of {engine_bytes / 2**20:.0f} MiB"
    assert q4_1_bytes > engine_bytes // 3  # SmolLM2's decoder linears: most of what a step reads
    assert mapped >= 0.9 * q4_1_bytes, f"the Q4_1 records are not read from the mapped file ({mapped / 2**20:.0f} MiB)"
    # the rest of the engine (the 8-bit embedding and head, which ONNX Runtime's kernels copy) and the runtime's own
    assert anonymous < engine_bytes - q4_1_bytes + ANONYMOUS_SLACK, \
        f"{anonymous / 2**20:.0f} MiB anonymous: the Q4_1 records were copied out of the mapped file"
