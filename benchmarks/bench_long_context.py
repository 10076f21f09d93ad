"""Decode at long contexts on a 1B-shaped random model: per-token time against the KV bytes each step reads.

    nice .venv/bin/python benchmarks/bench_long_context.py [--dir /tmp/kiln-longctx] [--layers 16]
        [--contexts 1024,8192,32768] [--rounds 7] [--threads 2] [--libraries A.so B.so ...] [--cpu-time]

Writes a random-weight Llama-3.2-1B-shaped checkpoint (benchmarks/scale/checkpoints.py; --layers shrinks its
depth), builds it with `kiln build` at its defaults but --quantization int4-q4_1 (float16 KV; the context is the
model's own, 131072, so the build's 128k cos/sin tables are measured too), and times single-sequence decode steps
at each context through the runtime's OrtModelRunner. The KV blocks of a context are filled with random K/V
rather than prefilled (a 32k-token prefill of a 1B model takes most of an hour on two cores, and a decode step
reads the same bytes either way). Each round times one step at every context, interleaved, on this shared machine.

A decode step reads the weights once and K and V of every cached position in every layer, so its time should grow
with the context by at most the extra KV bytes over the memory's read bandwidth (measured here, the best of
numpy reductions on every core): the report gives each context's step time, the KV bytes it reads, and the
measured growth over 1k against that prediction (at or below it: attention streams the cache at least as fast
as memory delivers it). One layer's kiln.PagedAttention decode call is then timed alone at each context (same
head shapes and KV dtype, a pool of exactly that context): its time per cached position, flat from 8k to 32k
when the kernel keeps its speed, and the rate at which it reads K/V.

--libraries times several builds of the op library (e.g. a copy of runtime/ops/libkiln_ops.so from before a
change, and the rebuilt one), each in its own session, taking turns within every round. --cpu-time (one thread
only) times the calling thread's CPU time instead of the wall clock: with one intra-op thread ONNX Runtime runs
the whole step on the calling thread, so the figure is the step's work, without the time the scheduler of a
shared machine gives other processes in between (the read bandwidth is then one thread's, timed alike).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "scale"))
from checkpoints import SHAPES, write_checkpoint, write_smollm2_tokenizer  # noqa: E402
from run import cpu_model  # noqa: E402

KILN = Path(sys.executable).with_name("kiln")


def build(work: Path, layers: int) -> tuple[Path, float]:
    """The engine dir (built once per --dir) and the build's wall seconds (0 when it existed)."""
    shape = dataclasses.replace(SHAPES["llama-3.2-1b"], layers=layers)
    model, engine = work / f"llama-3.2-1b-{layers}l", work / f"llama-3.2-1b-{layers}l-engine"
    if (engine / "manifest.json").is_file():
        return engine, 0.0
    if not (model / "config.json").is_file():
        write_checkpoint(shape, model)
        write_smollm2_tokenizer(model)
    start = time.perf_counter()
    subprocess.run(["nice", str(KILN), "build", str(model), "-o", str(engine), "--quantization", "int4-q4_1"],
                   check=True)
    return engine, time.perf_counter() - start


def clock(cpu_time: bool):
    return time.thread_time if cpu_time else time.perf_counter


def open_runner(engine: Path, library: str, num_blocks: int, threads: int):
    """An OrtModelRunner of the engine on one op library build (kiln.runtime.ort_runner.open_session's options)."""
    import onnxruntime as ort

    from kiln.manifest import read_manifest
    from kiln.runtime.loader import engine_kv_pools
    from kiln.runtime.ort_runner import OrtModelRunner

    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.log_severity_level = 3
    session = ort.InferenceSession(str(engine / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return OrtModelRunner(session, engine_kv_pools(read_manifest(engine)), num_blocks)


def read_bandwidth_gbps(cpu_time: bool) -> float:
    """Best-of-5 read bandwidth, GB/s: kiln bench's (numpy reductions on every core), or with cpu_time one
    thread's max over 256 MiB timed by its CPU time."""
    from kiln.runtime.bench.offline import memory_bandwidth_gbps

    if not cpu_time:
        return float(memory_bandwidth_gbps()["read_gbps"])
    a = np.ones(64 << 20, dtype=np.float32)
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        a.max()
        best = min(best, time.thread_time() - start)
    return a.nbytes / best / 1e9


def decode_step(runner, context: int, token: int):
    """One decode step of a sequence whose first context - 1 tokens are cached in blocks 0, 1, ..."""
    from kiln.runtime.model_runner import Chunk, pack_chunks

    table = list(range(-(-context // runner.block_size)))
    batch = pack_chunks([Chunk(context - 1, [token], table)], all_rows=False)
    return lambda: runner.execute(batch)


def attention_alone(spec, kv_dtype: str, contexts: list[int], args) -> dict[tuple[str, int], float]:
    """Seconds of one layer's kiln.PagedAttention decode call at each context and library (the model's head
    shapes, its KV dtype, RoPE in the op), best of `rounds` interleaved rounds of 5 calls."""
    import onnxruntime as ort

    from kiln.contract import KV_DTYPES
    from kiln.paged_attention import PagedAttentionAttrs, make_single_op_model

    H, HKV, D, BS = spec.num_heads, spec.num_kv_heads, spec.head_dim, 16
    dtype = KV_DTYPES[kv_dtype]
    model = make_single_op_model(PagedAttentionAttrs(H, HKV, scale=D**-0.5), D, BS, dtype).SerializeToString()
    rng = np.random.default_rng(1)
    calls = {}
    for library in args.libraries:
        options = ort.SessionOptions()
        options.register_custom_ops_library(library)
        options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        for c in contexts:
            blocks = -(-c // BS)
            pool = rng.standard_normal((blocks, 2, HKV, BS, D), dtype=np.float32).astype(dtype)
            feeds = {"query": rng.standard_normal((1, H * D), dtype=np.float32),
                     "key": rng.standard_normal((1, HKV * D), dtype=np.float32),
                     "value": rng.standard_normal((1, HKV * D), dtype=np.float32),
                     "block_tables": rng.permutation(blocks).astype(np.int32)[None],
                     "seq_lens": np.array([c], np.int32), "query_start_loc": np.array([0, 1], np.int32)}
            binding = session.io_binding()
            for name, array in feeds.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
            value = ort.OrtValue.ortvalue_from_numpy(pool)
            binding.bind_ortvalue_input("kv_cache", value)
            binding.bind_ortvalue_output("kv_cache_out", value)
            binding.bind_output("out", "cpu")
            calls[library, c] = (session, binding, pool, value)
    now = clock(args.cpu_time)
    best = {key: float("inf") for key in calls}
    for _ in range(args.rounds):
        for c in contexts:
            for library in args.libraries:
                session, binding, _, _ = calls[library, c]
                start = now()
                for _ in range(5):
                    session.run_with_iobinding(binding)
                best[library, c] = min(best[library, c], (now() - start) / 5)
    return best


def measure(engine: Path, contexts: list[int], args) -> dict:
    from kiln.manifest import read_manifest

    manifest = read_manifest(engine)
    num_blocks = -(-max(contexts) // manifest.build.block_size)
    runners = {library: open_runner(engine, library, num_blocks, args.threads) for library in args.libraries}
    for runner in runners.values():  # K/V of the magnitude a model's are (fp16 pools: random normals)
        rng = np.random.default_rng(0)
        for pool in runner.pools:
            pool[...] = rng.standard_normal(pool.shape, dtype=np.float32).astype(pool.dtype)
    steps = {(lib, c): decode_step(r, c, 1000 + i) for lib, r in runners.items() for i, c in enumerate(contexts)}
    for step in steps.values():  # warm-up: first-run allocations, page faults
        step()
    now = clock(args.cpu_time)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for _ in range(args.rounds):
        for c in contexts:
            for library in args.libraries:
                start = now()
                steps[library, c]()
                times[library, c].append(now() - start)
    spec = manifest.spec
    first = next(iter(runners.values()))
    kv_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * np.dtype(first.pool_spec.dtype).itemsize
    del runners, steps, first  # the pools: the op alone gets its own
    bandwidth = read_bandwidth_gbps(args.cpu_time)
    attention = attention_alone(spec, manifest.build.kv_dtype, contexts, args)
    base = contexts[0]
    result: dict = {"bandwidth_read_gbps": round(bandwidth, 2), "kv_bytes_per_token": int(kv_token), "libraries": {}}
    for library in args.libraries:
        rows = result["libraries"][library] = {}
        for c in contexts:
            median = statistics.median(times[library, c])
            predicted = (c - base) * kv_token / (bandwidth * 1e9)
            growth = median - statistics.median(times[library, base])
            op = attention[library, c]
            rows[c] = {"median_ms": round(median * 1e3, 2), "best_ms": round(min(times[library, c]) * 1e3, 2),
                       "kv_mib": round(c * kv_token / 2**20, 1), "growth_ms": round(growth * 1e3, 2),
                       "predicted_growth_ms": round(predicted * 1e3, 2), "attention_layer_ms": round(op * 1e3, 3),
                       "attention_ns_per_position": round(op / c * 1e9, 1),
                       "attention_gbps": round(c * kv_token / spec.num_layers / op / 1e9, 2)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kiln-longctx"))
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (Llama-3.2-1B has 16)")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--libraries", nargs="+", help="op library builds to compare (default: the installed one)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the calling thread's CPU time (needs --threads 1), not the wall clock")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1: other threads' work is not the calling thread's CPU time")
    if not args.libraries:
        from kiln.runtime.ops import library_path

        args.libraries = [library_path()]
    args.dir.mkdir(parents=True, exist_ok=True)
    engine, build_s = build(args.dir, args.layers)
    contexts = [int(c) for c in args.contexts.split(",")]
    result = measure(engine, contexts, args)
    data = sum(p.stat().st_size for p in engine.glob("model.onnx*"))
    result.update(cpu=cpu_model(), layers=args.layers, threads=args.threads, build_s=round(build_s, 1),
                  engine_mib=round(data / 2**20, 1), clock="thread CPU time" if args.cpu_time else "wall")
    print(json.dumps(result, indent=1))
    print("| library | context | step (median, best) | KV read | growth over the first | KV bytes / read bandwidth | "
          "one layer's attention (best) | per cached position | its KV read rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for library, rows in result["libraries"].items():
        for c, r in rows.items():
            print(f"| {Path(library).name} | {c} | {r['median_ms']} ms, {r['best_ms']} ms | {r['kv_mib']} MiB | "
                  f"{r['growth_ms']} ms | {r['predicted_growth_ms']} ms | {r['attention_layer_ms']} ms | "
                  f"{r['attention_ns_per_position']} ns | {r['attention_gbps']} GB/s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
