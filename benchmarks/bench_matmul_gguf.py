"""Benchmark kiln.MatMulGGUF (a GGUF file's own blocks) against kiln.MatMulQ4_1 at a 1B model's linear shapes.

Ways, one linear y = x @ W^T each:
  q4_1            kiln.MatMulQ4_1 (kiln's repacked Q4_1, int8 activations): what a Q4_K_M file is re-rounded to today
  q4_k q5_k q6_k q8_0 q4_0   kiln.MatMulGGUF on random valid blocks of that type, float32 activations
  q4_k-i8 q5_k-i8 ...        the same blocks with int8 activations (int8_activations = 1: integer block dots)
  q4_k-rec q6_k-rec          Q4_K / Q6_K blocks stored as records (layout "records": kiln.MatMulQ4_1's tile)
Shapes (Llama-3.2-1B): fused qkv 2048 -> 3072, o 2048 -> 2048, up 2048 -> 8192, fused gate/up 2048 -> 16384,
down 8192 -> 2048.
Each way cycles through sessions each with its own copy of the weights, enough copies (at least --copies) for
--cold-mib of weights, so that a call streams its weights from DRAM (more than the last-level cache holds), as a
real 1B decode step does. The
ways' batches are interleaved round by round (a shared machine's drift hits them alike); 2-thread wall time (or
--threads 1 --cpu-time), median of --repeats. GB/s is the weight bytes a call reads (the op's own input bytes) over
its time.

    python benchmarks/bench_matmul_gguf.py [--repeats 7] [--tokens 1 16] [--linears gate/up down] [--copies 4]
        [--cold-mib 96] [--threads 2] [--cpu-time] [--ways q4_1 q4_k q4_k-i8 q6_k-i8 q8_0-i8]
        [--baseline-library OLD.so]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kiln.gguf_blocks import GgmlType, dequantize, random_blocks
from kiln.gguf_records import RECORDS
from kiln.matmul_gguf import make_single_op_model as gguf_model
from kiln.matmul_q4_1 import make_single_op_model as q4_1_model
from kiln.optimize.quant.rtn import quantize_q4_1
from kiln.runtime.ort_runner import open_session

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "up": (2048, 8192), "gate/up": (2048, 16384), "down": (8192, 2048)}
TYPES = {"q4_k": GgmlType.Q4_K, "q5_k": GgmlType.Q5_K, "q6_k": GgmlType.Q6_K, "q8_0": GgmlType.Q8_0,
         "q4_0": GgmlType.Q4_0}
INT8_SUFFIX = "-i8"
RECORDS_SUFFIX = "-rec"
RECORDS_WAYS = ["q4_k" + RECORDS_SUFFIX, "q6_k" + RECORDS_SUFFIX]
WAYS = ["q4_1", *TYPES, *(name + INT8_SUFFIX for name in TYPES), *RECORDS_WAYS]
OLD_SUFFIX = "@old"  # a way on --baseline-library


def ways(k: int, n: int, names: list[str], cold_bytes: int, threads: int,
         baseline: str | None = None) -> dict[str, tuple[list, int]]:
    """name -> (sessions, weight bytes a call reads), each way's copies at least cold_bytes in all; with a baseline
    library, each GGUF way also as NAME@old on it (the same blocks), run just before NAME in every round."""
    out = {}
    for full in [w for name in names for w in ([name + OLD_SUFFIX] if baseline and name != "q4_1" else []) + [name]]:
        name, library = full.removesuffix(OLD_SUFFIX), baseline if full.endswith(OLD_SUFFIX) else None
        rng = np.random.default_rng(list(WAYS).index(name))  # NAME and NAME@old: the same weights
        sessions, nbytes = [], 0
        while not sessions or len(sessions) * nbytes < cold_bytes:
            if name == "q4_1":  # Q4_1 of a Q4_K's decoded weights: the re-rounding path
                w = quantize_q4_1(dequantize(random_blocks(rng, GgmlType.Q4_K, n, k), GgmlType.Q4_K))
                qs, dm = w.pack()
                nbytes = qs.nbytes + dm.nbytes
                sessions.append(open_session(q4_1_model(w).SerializeToString(), threads))
            elif name in RECORDS_WAYS:
                kind = TYPES[name.removesuffix(RECORDS_SUFFIX)]
                blocks = random_blocks(rng, kind, n, k)
                model = gguf_model(blocks, kind, int8_activations=True, layout=RECORDS)
                nbytes = model.graph.initializer[0].ByteSize()
                sessions.append(open_session(model.SerializeToString(), threads, library))
            else:
                kind = TYPES[name.removesuffix(INT8_SUFFIX)]
                blocks = random_blocks(rng, kind, n, k)
                nbytes = blocks.nbytes
                model = gguf_model(blocks, kind, int8_activations=name.endswith(INT8_SUFFIX))
                sessions.append(open_session(model.SerializeToString(), threads, library))
        out[full] = (sessions, nbytes)
    return out


def time_us(all_ways: dict[str, tuple[list, int]], x: np.ndarray, repeats: int, clock) -> dict[str, float]:
    """Median microseconds a call per way: every round runs each way's ~20 ms batch in turn."""
    feed = {"x": x}
    calls = {}
    for name, (copies, _) in all_ways.items():
        for s in copies:
            s.run(None, feed)
        start, count = clock(), 0
        while clock() - start < 0.02 or count % len(copies):
            copies[count % len(copies)].run(None, feed)
            count += 1
        calls[name] = count
    batches: dict[str, list[float]] = {name: [] for name in all_ways}
    for _ in range(repeats):
        for name, (copies, _) in all_ways.items():
            start = clock()
            for i in range(calls[name]):
                copies[i % len(copies)].run(None, feed)
            batches[name].append((clock() - start) / calls[name] * 1e6)
    return {name: statistics.median(b) for name, b in batches.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--linears", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ways", nargs="+", default=["q4_1", "q4_k", "q4_k-i8", "q6_k-i8", "q8_0-i8"], choices=WAYS)
    parser.add_argument("--copies", type=int, default=4, help="weight copies a way cycles through (cold weights)")
    parser.add_argument("--cold-mib", type=float, default=96, help="weights a way cycles through, at least")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU time (with --threads 1: what other load barely moves)")
    parser.add_argument("--baseline-library", help="an older libkiln_ops.so: each GGUF way also as NAME@old on it")
    args = parser.parse_args()
    clock = "CPU" if args.cpu_time else "wall"
    print(f"threads {args.threads}, >= {args.cold_mib:.0f} MiB of weights a way, {clock} time; "
          "us a call (GB/s of weights read), ratio to q4_1's time")
    for linear in args.linears:
        k, n = SHAPES[linear]
        q4_k_bytes = n * k // 256 * 144
        cold_bytes = max(args.copies, -(-int(args.cold_mib * 2**20) // q4_k_bytes)) * q4_k_bytes
        built = ways(k, n, args.ways, cold_bytes, args.threads, args.baseline_library)
        for t in args.tokens:
            x = np.random.default_rng(1).standard_normal((t, k)).astype(np.float32)
            times = time_us(built, x, args.repeats, time.process_time if args.cpu_time else time.perf_counter)
            base = times.get("q4_1")
            cells = []
            for name, us in times.items():
                gbs = built[name][1] / (us * 1e-6) / 1e9
                ratio = f" x{us / base:.2f}" if base and name != "q4_1" else ""
                if name + OLD_SUFFIX in times:
                    ratio += f" new/old {us / times[name + OLD_SUFFIX]:.2f}"
                cells.append(f"{name} {us:8.0f} ({gbs:5.1f}){ratio}")
            print(f"{linear:8s} K={k:5d} N={n:5d} T={t:4d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
