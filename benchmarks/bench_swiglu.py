"""kiln.SwiGLU against what ONNX Runtime ran before it (Split -> Sigmoid -> Mul -> Mul, which ORT turns into
Split + QuickGelu + Mul) on x [T, 2F], one thread, per MLP activation.

    .venv/bin/python benchmarks/bench_swiglu.py [--width 1536] [--rows 1 16 64 256] [--rounds 7] [--threads 1]

Each graph holds --nodes copies of the activation reading the same input (common-subexpression elimination
off), so one session.run times that many activations and the Python call's overhead is spread over them. Time
is the calling thread's CPU time at --threads 1 (a shared machine's load does not enter it), wall time
otherwise; rounds interleave the two graphs; the median µs per activation is printed, with the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, TensorProto, helper, numpy_helper

from kiln.contract import OP_DOMAIN
from kiln.runtime.ops import library_path
from kiln.swiglu import OP_TYPE, OP_VERSION


def graph(fused: bool, width: int, nodes: int) -> ModelProto:
    sizes = numpy_helper.from_array(np.array([width, width], np.int64), "sizes")
    body, outputs = [], []
    for i in range(nodes):
        if fused:
            body.append(helper.make_node(OP_TYPE, ["x"], [f"y{i}"], domain=OP_DOMAIN))
        else:
            body += [helper.make_node("Split", ["x", "sizes"], [f"g{i}", f"u{i}"], axis=-1),
                     helper.make_node("Sigmoid", [f"g{i}"], [f"s{i}"]),
                     helper.make_node("Mul", [f"g{i}", f"s{i}"], [f"a{i}"]),
                     helper.make_node("Mul", [f"a{i}", f"u{i}"], [f"y{i}"])]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["T", width]))
    g = helper.make_graph(body, "act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 2 * width])],
                          outputs, [sizes])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(OP_DOMAIN, OP_VERSION)]
    model = helper.make_model(g, opset_imports=opsets)
    model.ir_version = 8
    return model


def session(model: ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library_path())
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["CommonSubexpressionElimination"])


def per_node_us(sess: ort.InferenceSession, x: np.ndarray, nodes: int, repeats: int, cpu: bool) -> float:
    clock = time.thread_time if cpu else time.perf_counter
    sess.run(None, {"x": x})
    start = clock()
    for _ in range(repeats):
        sess.run(None, {"x": x})
    return (clock() - start) / repeats / nodes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1536, help="F (SmolLM2: 1536)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--nodes", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sessions = {name: session(graph(name == "SwiGLU", args.width, args.nodes), args.threads)
                for name in ("before", "SwiGLU")}
    print("| rows | Split+QuickGelu+Mul µs | SwiGLU µs | SwiGLU ns/element | ratio |\n|---|---|---|---|---|")
    for rows in args.rows:
        x = (np.random.default_rng(0).standard_normal((rows, 2 * args.width)) * 3).astype(np.float32)
        repeats = max(3, 20000 // rows)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for r in range(args.rounds):
            for name in (list(sessions) if r % 2 == 0 else list(sessions)[::-1]):
                times[name].append(per_node_us(sessions[name], x, args.nodes, repeats, args.threads == 1))
        before, fused = (statistics.median(times[n]) for n in sessions)
        print(f"| {rows} | {before:.2f} | {fused:.2f} | {fused * 1e3 / (rows * args.width):.3f} | "
              f"{before / fused:.2f}x |")


if __name__ == "__main__":
    main()
