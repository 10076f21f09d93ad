"""What Medusa heads add to a step: the LM head (SmolLM2's tied [576, 49152] fp32 head) run on L logits rows
vs on L + M*K rows (K heads at M rows), in ONNX Runtime on one thread.

    .venv/bin/python benchmarks/bench_medusa_head.py [--hidden 576] [--vocab 49152] [--heads 4] [--rounds 7]

CPU time of the calling thread (ORT runs a 1-thread session on it), so a shared machine's load does not
enter the figure; rounds interleave the row counts; the median per row count is printed, and its ratio to
the L-row step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def head_session(hidden: int, vocab: int) -> ort.InferenceSession:
    weight = np.random.default_rng(0).standard_normal((hidden, vocab), dtype=np.float32) * 0.05
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "rows", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "rows", vocab])],
        [numpy_helper.from_array(weight, "w")])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    session = head_session(args.hidden, args.vocab)
    # (logits rows L, Medusa rows M): decode of 1 and 16 sequences, without heads, with heads on every row
    cases = [(1, 0), (1, 1), (16, 0), (16, 16), (16, 1)]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for logits_rows, medusa_rows in cases:
            x = np.random.default_rng(1).standard_normal((1, logits_rows + medusa_rows * args.heads), np.float32)
            x = np.ascontiguousarray(np.broadcast_to(x[..., None], (*x.shape, args.hidden)))
            session.run(None, {"x": x})
            start = time.thread_time()
            for _ in range(args.calls):
                session.run(None, {"x": x})
            times[(logits_rows, medusa_rows)].append((time.thread_time() - start) / args.calls)
    for logits_rows, medusa_rows in cases:
        median = statistics.median(times[(logits_rows, medusa_rows)])
        base = statistics.median(times[(logits_rows, 0)])
        print(f"L={logits_rows:3d} M={medusa_rows:3d} rows={logits_rows + medusa_rows * args.heads:3d}: "
              f"{median * 1e3:7.2f} ms CPU per call, {median / base:5.2f}x the L-row head")


if __name__ == "__main__":
    main()
