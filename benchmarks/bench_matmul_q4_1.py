"""Benchmark kiln.MatMulQ4_1 against ONNX Runtime's MatMulNBits on SmolLM2-135M's linears.

Three ways to run one linear y = x @ W^T:
  q4_1     kiln.MatMulQ4_1 (Q4_1 weights, int8 activations per block of 32): int4-q4_1 engines now;
  nbits    com.microsoft::MatMulNBits int4, block 32, accuracy_level 4 (int8 activations): what
           onnxruntime-genai's int4 CPU model runs, and the cost Q4_1 should match at the same bits;
  offsets  MatMulNBits with integer zero points + Reshape/ReduceSum/MatMul/Add over the 32-wide
           block sums: int4-q4_1 engines before kiln.MatMulQ4_1.
Shapes: the fused qkv (576 -> 960), o (576 -> 576), fused gate/up (576 -> 3072) and down (1536 ->
576), at T = 1 (decode) and T = 64 (prefill). Times: 1-thread CPU time (process_time; other load on
a shared machine barely moves it) and 2-thread wall time, median of --repeats batches.

    python benchmarks/bench_matmul_q4_1.py [--repeats 7]
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
from kiln.runtime.ops import library_path

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate/up": (576, 3072), "down": (1536, 576)}
TOKENS = (1, 64)


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


def session(model: bytes, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def time_us(sess: ort.InferenceSession, x: np.ndarray, clock, repeats: int) -> float:
    """Median microseconds per run over `repeats` batches of ~20 ms each."""
    feed = {"x": x}
    sess.run(None, feed)
    start = clock()
    calls = 0
    while clock() - start < 0.02:
        sess.run(None, feed)
        calls += 1
    batches = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            sess.run(None, feed)
        batches.append((clock() - start) / calls * 1e6)
    return statistics.median(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'linear':8} {'T':>3}  {'1-thread CPU us: q4_1 / nbits / offsets':>40}  "
          f"{'2-thread wall us: q4_1 / nbits / offsets':>41}")
    for name, (k, n) in SHAPES.items():
        graphs = models((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        for t in TOKENS:
            x = rng.standard_normal((t, k)).astype(np.float32)
            ref = session(graphs["offsets"], 1).run(None, {"x": x})[0]
            y = session(graphs["q4_1"], 1).run(None, {"x": x})[0]
            assert np.abs(y - ref).max() < 0.02 * np.abs(ref).max()  # the same linear (nbits: the same bits)
            cpu = [time_us(session(graphs[g], 1), x, time.process_time, args.repeats) for g in graphs]
            wall = [time_us(session(graphs[g], 2), x, time.perf_counter, args.repeats) for g in graphs]
            cpu_text, wall_text = (" / ".join(f"{v:7.1f}" for v in times) for times in (cpu, wall))
            print(f"{name:8} {t:3}  {cpu_text:>40}  {wall_text:>41}   q4_1/nbits CPU {cpu[0] / cpu[1]:.2f}x")


if __name__ == "__main__":
    main()
