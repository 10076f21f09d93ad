"""Benchmark kiln.MatMulQ4_1 against ONNX Runtime's MatMulNBits on SmolLM2-135M's linears.

Three ways to run one linear y = x @ W^T:
  q4_1     kiln.MatMulQ4_1 (Q4_1 weights, int8 activations per block of 32): int4-q4_1 engines now;
  nbits    com.microsoft::MatMulNBits int4, block 32, accuracy_level 4 (int8 activations): what
           onnxruntime-genai's int4 CPU model runs, and the cost Q4_1 should match at the same bits;
  offsets  MatMulNBits with integer zero points + Reshape/ReduceSum/MatMul/Add over the 32-wide
           block sums: int4-q4_1 engines before kiln.MatMulQ4_1.
Shapes: the fused qkv (576 -> 960), o (576 -> 576), fused gate/up (576 -> 3072) and down (1536 ->
576), at T = 1 (decode), 16 and 32 (batched decode) and 512 (prefill); `--tokens 1 2 4 6 8 9 16` gives
the few-rows curve of speculative verification (k guesses: k + 1 rows), each way's time also printed
relative to its own T = 1 when T = 1 is measured first. Times: 1-thread CPU time
(process_time; other load on a shared machine barely moves it) and 2-thread wall time, median of
--repeats batches of ~20 ms, the three graphs' batches interleaved (a drift hits all three alike).

    python benchmarks/bench_matmul_q4_1.py [--repeats 7] [--tokens 1 16 32 512] [--linears qkv down]
        [--baseline-library OTHER/libkiln_ops.so] [--copies 60]

--baseline-library adds a fourth way, "base": kiln.MatMulQ4_1 from another build of the op library
(e.g. main's), timed interleaved with the others for a before/after ratio in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kiln.matmul_q4_1 import BLOCK, make_single_op_model
from kiln.optimize.quant.rtn import quantize_q4_1
from kiln.runtime.ort_runner import open_session

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate/up": (576, 3072), "down": (1536, 576)}
TOKENS = (1, 16, 32, 512)


def _nbits_node(n: int, k: int, q: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> tuple[list, object]:
    """MatMulNBits int4 (block 32, accuracy_level 4) of q [N, K] in 0..15 with integer zero points [N, K/32]."""
    nibbles = q.reshape(n, k // BLOCK, BLOCK // 2, 2)
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(np.uint8)
    zp = zero_points.reshape(n, -1)
    if zp.shape[1] % 2:
        zp = np.concatenate([zp, np.zeros((n, 1), np.uint8)], axis=1)
    zp_packed = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    inits = [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales.reshape(-1).astype(np.float32), "s"),
             numpy_helper.from_array(zp_packed, "zp")]
    node = helper.make_node("MatMulNBits", ["x", "b", "s", "zp"], ["nb"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=BLOCK, accuracy_level=4)
    return inits, node


def _model(nodes: list, inits: list, k: int, n: int, output: str) -> bytes:
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["T", n])], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model.SerializeToString()


def models(w: np.ndarray) -> dict[str, bytes]:
    n, k = w.shape
    qw = quantize_q4_1(w)
    d, m = qw.d.astype(np.float32), qw.m.astype(np.float32)
    out = {"q4_1": make_single_op_model(qw).SerializeToString()}
    inits, node = _nbits_node(n, k, qw.q, d, np.full(d.shape, 8, np.uint8))
    out["nbits"] = _model([node], inits, k, n, "nb")
    # int4-q4_1 before: integer zero point z = round(-m / d), the rest of m an offset per block
    zero_points = np.clip(np.round(-m / np.where(d > 0, d, 1)), 0, 15).astype(np.uint8)
    offsets = (m + zero_points * d).astype(np.float32)
    inits, node = _nbits_node(n, k, qw.q, d, zero_points)
    inits += [numpy_helper.from_array(np.array([-1, k // BLOCK, BLOCK], np.int64), "shape"),
              numpy_helper.from_array(np.array([-1], np.int64), "axis"),
              numpy_helper.from_array(np.ascontiguousarray(offsets.T), "offsets")]
    side = [helper.make_node("Reshape", ["x", "shape"], ["g"]),
            helper.make_node("ReduceSum", ["g", "axis"], ["sums"], keepdims=0),
            helper.make_node("MatMul", ["sums", "offsets"], ["off"]),
            helper.make_node("Add", ["nb", "off"], ["y"])]
    out["offsets"] = _model([node, *side], inits, k, n, "y")
    return out


def time_us(sessions: dict[str, list[ort.InferenceSession]], x: np.ndarray, clock, repeats: int) -> list[float]:
    """Median microseconds per run of each way over `repeats` rounds, each round one ~20 ms batch of
    every way in turn; a way's calls cycle through its sessions (copies of the weights)."""
    feed = {"x": x}

    def run_batch(copies: list[ort.InferenceSession], calls: int) -> None:
        for i in range(calls):
            copies[i % len(copies)].run(None, feed)

    calls = {}
    for name, copies in sessions.items():
        run_batch(copies, len(copies))
        start, calls[name] = clock(), 0
        while clock() - start < 0.02 or calls[name] % len(copies):
            copies[calls[name] % len(copies)].run(None, feed)
            calls[name] += 1
    batches: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(repeats):
        for name, copies in sessions.items():
            start = clock()
            run_batch(copies, calls[name])
            batches[name].append((clock() - start) / calls[name] * 1e6)
    return [statistics.median(b) for b in batches.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="activation rows T")
    parser.add_argument("--linears", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--baseline-library", help="another libkiln_ops.so whose kiln.MatMulQ4_1 to time as 'base'")
    parser.add_argument("--copies", type=int, default=1,
                        help="1-thread sessions per way, called in turn: e.g. 60 copies of a linear's weights outgrow "
                             "the caches, as a model's 30 layers do in decode (default 1: the weights stay cached; "
                             "more than 1 skips the 2-thread wall times)")
    args = parser.parse_args()
    libraries = {"q4_1": None, "nbits": None, "offsets": None}
    if args.baseline_library:
        libraries["base"] = args.baseline_library
    rng = np.random.default_rng(0)
    ways = " / ".join(libraries)
    print(f"{'linear':8} {'T':>3}  {'1-thread CPU us: ' + ways:>48}  {'2-thread wall us: ' + ways:>49}")
    for name in args.linears:
        k, n = SHAPES[name]
        graphs = models((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        graphs["base"] = graphs["q4_1"]
        single: list[float] | None = None  # this linear's times at T = 1
        for t in args.tokens:
            x = rng.standard_normal((t, k)).astype(np.float32)
            ref = open_session(graphs["offsets"], 1).run(None, {"x": x})[0]
            y = open_session(graphs["q4_1"], 1).run(None, {"x": x})[0]
            assert np.abs(y - ref).max() < 0.02 * np.abs(ref).max()  # the same linear (nbits: the same bits)
            copies = {g: [open_session(graphs[g], 1, lib) for _ in range(args.copies)] for g, lib in libraries.items()}
            cpu = time_us(copies, x, time.process_time, args.repeats)
            # copies x 2-thread sessions would each spin a pool thread: wall time only with one copy
            wall = [float("nan")] * len(cpu)
            if args.copies == 1:
                two_threads = {g: [open_session(graphs[g], 2, lib)] for g, lib in libraries.items()}
                wall = time_us(two_threads, x, time.perf_counter, args.repeats)
            cpu_text, wall_text = (" / ".join(f"{v:7.1f}" for v in times) for times in (cpu, wall))
            if t == 1:
                single = cpu
            ratios = f"q4_1/nbits CPU {cpu[0] / cpu[1]:.2f}x wall {wall[0] / wall[1]:.2f}x"
            if single is not None:
                ratios += ", CPU / T=1: " + " / ".join(f"{v / v1:.2f}" for v, v1 in zip(cpu, single, strict=True))
            if len(cpu) > 3:
                ratios += f", q4_1/base CPU {cpu[0] / cpu[3]:.2f}x wall {wall[0] / wall[3]:.2f}x"
            print(f"{name:8} {t:3}  {cpu_text:>48}  {wall_text:>49}   {ratios}", flush=True)


if __name__ == "__main__":
    main()
