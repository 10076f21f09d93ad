"""Decode at long contexts on a 1B-shaped random model: per-token time against the KV bytes each step reads.

    nice .venv/bin/python benchmarks/bench_long_context.py [--dir /tmp/kiln-longctx] [--layers 16]
        [--contexts 1024,8192,32768] [--rounds 7] [--threads 2]

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


def decode_step(runner, context: int, token: int):
    """One decode step of a sequence whose first context - 1 tokens are cached in blocks 0, 1, ..."""
    from kiln.runtime.model_runner import Chunk, pack_chunks

    table = list(range(-(-context // runner.block_size)))
    batch = pack_chunks([Chunk(context - 1, [token], table)], all_rows=False)
    return lambda: runner.execute(batch)


def attention_alone(spec, kv_dtype: str, contexts: list[int], rounds: int, threads: int) -> dict[int, float]:
    """Seconds of one layer's kiln.PagedAttention decode call at each context (the model's head shapes, its KV
    dtype, RoPE in the op), best of `rounds` interleaved rounds of 5 calls: the attention share of a step."""
    import onnxruntime as ort

    from kiln.contract import KV_DTYPES
    from kiln.paged_attention import PagedAttentionAttrs, make_single_op_model
    from kiln.runtime.ops import library_path

    H, HKV, D, BS = spec.num_heads, spec.num_kv_heads, spec.head_dim, 16
    dtype = KV_DTYPES[kv_dtype]
    options = ort.SessionOptions()
    options.register_custom_ops_library(library_path())
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    model = make_single_op_model(PagedAttentionAttrs(H, HKV, scale=D**-0.5), D, BS, dtype)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    calls = {}
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
        calls[c] = (binding, pool, value)
    best = {c: float("inf") for c in contexts}
    for _ in range(rounds):
        for c, (binding, _, _) in calls.items():
            start = time.perf_counter()
            for _ in range(5):
                session.run_with_iobinding(binding)
            best[c] = min(best[c], (time.perf_counter() - start) / 5)
    return best


def measure(engine: Path, contexts: list[int], rounds: int, threads: int) -> dict:
    from kiln.manifest import read_manifest
    from kiln.runtime.bench.offline import memory_bandwidth_gbps
    from kiln.runtime.loader import open_engine_runner

    manifest = read_manifest(engine)
    num_blocks = -(-max(contexts) // manifest.build.block_size)
    runner = open_engine_runner(engine, manifest, num_blocks, threads)
    rng = np.random.default_rng(0)
    for pool in runner.pools:  # K/V of the magnitude a model's are (fp16 pools: random normals)
        pool[...] = rng.standard_normal(pool.shape, dtype=np.float32).astype(pool.dtype)
    steps = {c: decode_step(runner, c, 1000 + i) for i, c in enumerate(contexts)}
    for step in steps.values():  # warm-up: first-run allocations, page faults
        step()
    times: dict[int, list[float]] = {c: [] for c in contexts}
    for _ in range(rounds):
        for c, step in steps.items():
            start = time.perf_counter()
            step()
            times[c].append(time.perf_counter() - start)
    spec = manifest.spec
    kv_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * np.dtype(runner.pool_spec.dtype).itemsize
    bandwidth = memory_bandwidth_gbps()["read_gbps"]
    del runner  # the pools: the op alone gets its own
    attention = attention_alone(spec, manifest.build.kv_dtype, contexts, rounds, threads)
    base = contexts[0]
    result = {"bandwidth_read_gbps": bandwidth, "kv_bytes_per_token": int(kv_token), "contexts": {}}
    for c in contexts:
        median = statistics.median(times[c])
        predicted = (c - base) * kv_token / (bandwidth * 1e9)
        growth = median - statistics.median(times[base])
        result["contexts"][c] = {"median_ms": round(median * 1e3, 2), "best_ms": round(min(times[c]) * 1e3, 2),
                                 "kv_mib": round(c * kv_token / 2**20, 1), "growth_ms": round(growth * 1e3, 2),
                                 "predicted_growth_ms": round(predicted * 1e3, 2),
                                 "attention_layer_ms": round(attention[c] * 1e3, 3),
                                 "attention_ns_per_position": round(attention[c] / c * 1e9, 1),
                                 "attention_gbps": round(c * kv_token / spec.num_layers / attention[c] / 1e9, 2)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kiln-longctx"))
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (Llama-3.2-1B has 16)")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    engine, build_s = build(args.dir, args.layers)
    contexts = [int(c) for c in args.contexts.split(",")]
    result = measure(engine, contexts, args.rounds, args.threads)
    data = sum(p.stat().st_size for p in engine.glob("model.onnx*"))
    result.update(cpu=cpu_model(), layers=args.layers, threads=args.threads, build_s=round(build_s, 1),
                  engine_mib=round(data / 2**20, 1))
    print(json.dumps(result, indent=1))
    print("| context | step (median, best) | KV read | growth over the first | KV bytes / read bandwidth | "
          "one layer's attention (best) | per cached position | its KV read rate |")
    print("|---|---|---|---|---|---|---|---|")
    for c, r in result["contexts"].items():
        print(f"| {c} | {r['median_ms']} ms, {r['best_ms']} ms | {r['kv_mib']} MiB | {r['growth_ms']} ms | "
              f"{r['predicted_growth_ms']} ms | {r['attention_layer_ms']} ms | {r['attention_ns_per_position']} ns | "
              f"{r['attention_gbps']} GB/s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
