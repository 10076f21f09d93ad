"""Where a decode step's model time goes: ONNX Runtime's own profile, summed per op type.

Loads an engine, swaps its runner for one whose session has ORT profiling on (optionally with
another build of the op library, e.g. main's, for a before/after), generates `batch` greedy
requests of --max-tokens tokens (ignore_eos) for each batch size, and takes each node's fastest
kernel time over the pure decode steps (all `batch` sequences compute one token each; prefill runs
are left out; decode steps repeat the same work, and a busy machine's preemption only ever adds
time), summed per op type. Prints, per batch size, ms per decode step and each op type's share.

    python benchmarks/profile_ops.py ENGINE_DIR [--batches 1 32] [--max-tokens 64] [--threads 1]
        [--library OTHER/libkiln_ops.so] [--stat min|median] [--nodes [--read-gbps GB/S]]

--nodes adds a table per kind of node (an op type; a MatMulGGUF by its ggml type and K -> N): its nodes' summed
time against the initializer bytes they read for a token over the measured read bandwidth (kiln bench's numpy
read), i.e. how far each kind of linear is from streaming its weights at memory speed; the model run's time outside
the kernels (ONNX Runtime between nodes, and the profiler's own cost) is its last row.

An `If` node's time (the int4-rescored head's switch) includes its branch's nodes, which are listed too.

With --threads 1 a node's fastest time is close to its CPU time even on a busy machine (a median
would not be: at a load of 8 per core a 10 ms node is preempted in most steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import onnx
import onnxruntime as ort

from kiln.gguf_blocks import ggml_type, row_weights
from kiln.optimize.weight_bytes import node_bytes_per_token
from kiln.runtime.bench.offline import memory_bandwidth_gbps
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.model_runner import RunnerOutput, build_batch
from kiln.runtime.ops import library_path
from kiln.runtime.ort_runner import OrtModelRunner, graph_kv_pools
from kiln.runtime.params import RuntimeConfig, SamplingParams

TOPICS = ["a lighthouse", "the moon", "bread", "a river", "chess", "winter", "a robot", "the ocean"]


def profiled_runner(engine_dir: Path, threads: int, num_blocks: int, library: str, prefix: str) -> OrtModelRunner:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    options.log_severity_level = 3
    session = ort.InferenceSession(str(engine_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return OrtModelRunner(session, graph_kv_pools(session), num_blocks)


def generate(llm_engine: Engine, batch: int, max_tokens: int) -> list[bool]:
    """Runs batch greedy requests to the end; per model run, whether it was a pure decode step."""
    tok = llm_engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Write a short story about {TOPICS[i % 8]}."}])
        llm_engine.add_request(f"ops-{batch}-{i}", prompt, params)
    decode_runs = []
    while llm_engine.has_unfinished():
        out = llm_engine.scheduler.schedule()
        if not out:
            raise RuntimeError("nothing could be scheduled: the KV pool is too small for the batch")
        # the whole batch decoding: with a CPU step budget the first prompts decode while later ones prefill
        decode_runs.append(out.num_tokens == len(out.scheduled) == batch)
        llm_engine._postprocess(out, RunnerOutput(llm_engine.runner.execute(build_batch(out))), None)
    return decode_runs


def node_times(profile: Path, decode: list[bool],
               stat: str = "min") -> tuple[dict[tuple[str, str], float], int, float]:
    """Per (op type, node name), the node's fastest (stat "min") or median kernel microseconds over the decode
    runs; the number of those runs; and their fastest or median wall microseconds (the whole model run)."""
    events = json.loads(profile.read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    if len(runs) != len(decode):
        raise RuntimeError(f"the profile holds {len(runs)} model runs, the generation made {len(decode)}")
    windows = [(r["ts"], r["ts"] + r["dur"]) for r, is_decode in zip(runs, decode, strict=True) if is_decode]
    per_node: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if any(start <= e["ts"] <= end for start, end in windows):
            per_node[(e["args"]["op_name"], e["name"])].append(e["dur"])
    pick = min if stat == "min" else statistics.median
    times = {key: pick(d) for key, d in per_node.items()}
    run = pick([end - start for start, end in windows]) if windows else 0.0
    return times, len(windows), run


def per_op_type(times: dict[tuple[str, str], float]) -> dict[str, float]:
    """node_times' microseconds summed per op type."""
    totals: dict[str, float] = defaultdict(float)
    for (op, _), us in times.items():
        totals[op] += us
    return totals


def node_kinds(engine_dir: Path) -> dict[str, tuple[str, float]]:
    """Node name -> (its kind: the op type, a MatMulGGUF as "Q4_K 2048->16384"; the initializer bytes it reads for
    one token)."""
    graph = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False).graph
    nbytes = node_bytes_per_token(graph)
    dims = {t.name: list(t.dims) for t in graph.initializer}
    out = {}
    for node in graph.node:
        kind = node.op_type
        if node.op_type == "MatMulGGUF" and node.input[1] in dims:
            gtype = ggml_type(next(a.i for a in node.attribute if a.name == "ggml_type"))
            if len(dims[node.input[1]]) == 3:  # Q4_K records [N / 16, K / 256, 2368]
                groups, superblocks, _ = dims[node.input[1]]
                kind = f"{gtype.name} records {superblocks * 256}->{groups * 16}"
            else:
                n, row = dims[node.input[1]]
                kind = f"{gtype.name} {row_weights(gtype, row)}->{n}"
        out[node.name] = (kind, nbytes.get(node.name, 0.0))
    return out


def print_node_table(times: dict[tuple[str, str], float], kinds: dict[str, tuple[str, float]], run_us: float,
                     read_gbps: float) -> None:
    """Per kind of node: its nodes' summed microseconds against their bytes at read_gbps."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # kind -> [nodes, us, bytes]
    for (op, name), us in times.items():
        kind, nbytes = kinds.get(name.removesuffix("_kernel_time"), (op, 0.0))
        row = rows[kind]
        row[0], row[1], row[2] = row[0] + 1, row[1] + us, row[2] + nbytes
    print(f"| node kind | nodes | ms / step | MB read | ms at {read_gbps:.1f} GB/s | time / floor |")
    print("|---|---|---|---|---|---|")
    for kind, (count, us, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        floor_ms = nbytes / read_gbps / 1e6
        ratio = f"{us / 1e3 / floor_ms:.2f}" if floor_ms >= 0.001 else "-"
        print(f"| {kind} | {count} | {us / 1e3:.3f} | {nbytes / 1e6:.1f} | {floor_ms:.3f} | {ratio} |")
    kernels = sum(times.values())
    print(f"| between nodes (model run - kernels) | - | {(run_us - kernels) / 1e3:.3f} | - | - | - |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--library", default=None, help="the libkiln_ops.so to profile (default: this install's)")
    parser.add_argument("--stat", choices=["min", "median"], default="min",
                        help="each node's fastest time (robust on one thread) or its median (what two threads see)")
    parser.add_argument("--nodes", action="store_true", help="add the table per kind of node against its bytes")
    parser.add_argument("--read-gbps", type=float, default=None,
                        help="the read bandwidth the table sets bytes against (default: measured now, as kiln bench "
                             "does; on a busy host give a quiet measurement)")
    args = parser.parse_args()
    read_gbps = args.read_gbps or (memory_bandwidth_gbps()["read_gbps"] if args.nodes else 0.0)
    for batch in args.batches:
        llm_engine = load_engine(args.engine_dir, RuntimeConfig(max_num_seqs=batch, num_threads=args.threads))
        with tempfile.TemporaryDirectory(prefix="kiln-ops-") as tmp:
            runner = profiled_runner(args.engine_dir, args.threads, llm_engine.runner.num_blocks,
                                     args.library or library_path(), str(Path(tmp) / "ort"))
            llm_engine.runner = runner
            decode = generate(llm_engine, batch, args.max_tokens)
            times, steps, run_us = node_times(Path(runner.session.end_profiling()), decode, args.stat)
        totals = per_op_type(times)
        kernel = sum(totals.values())
        which = "fastest" if args.stat == "min" else "median"
        print(f"batch {batch}: {kernel / 1e3:.2f} ms of kernels per decode step ({which} of {steps} steps, "
              f"{args.threads} threads); a model run's {which} {run_us / 1e3:.2f} ms")
        print("| op type | ms / step | share |")
        print("|---|---|---|")
        for op, us in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"| {op} | {us / 1e3:.3f} | {100 * us / kernel:.1f}% |")
        if args.nodes:
            print()
            print_node_table(times, node_kinds(args.engine_dir), run_us, read_gbps)


if __name__ == "__main__":
    main()
