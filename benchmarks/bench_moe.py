"""kiln.MoE with Q4_1 experts against a dense SwiGLU MLP with the same active parameters (kiln.MatMulQ4_1 gate/up ->
kiln.SwiGLU -> kiln.MatMulQ4_1 down, the int4-q4_1 engine's dense MLP), one layer, random Q4_1 weights; or, with
--gguf-experts, kiln.MoE with GGUF experts (random blocks of the types given for gate, up and down: a Q4_K_M file's
are Q4_K Q4_K Q4_K or Q4_K Q4_K Q6_K by layer) against the same op with Q4_1 experts.

    .venv/bin/python benchmarks/bench_moe.py [--hidden 2048] [--expert-width 1024] [--experts 64] [--top-k 8]
                                             [--rows 1 16 128] [--rounds 7] [--threads 2]
                                             [--gguf-experts Q4_K Q4_K Q4_K] [--cpu-time]
                                             [--baseline-library OLD.so]

The defaults are OLMoE-1B-7B's layer: 64 experts of width 1024, 8 per token, so the dense MLP has width 8192.
A decode row reads 8 experts' bytes in either graph (the same weight budget); 16 rows route to most of the 64
experts, so the MoE layer then reads up to 8x the dense one's bytes, which no kernel can avoid. Rounds interleave
the two graphs; the median ms per layer is printed with the ratio MoE / dense (median and range over rounds).
--baseline-library adds the first graph on an older libkiln_ops.so (GGUF@old, or MoE@old) to every round and
prints new / old the same way; --cpu-time times with the process's CPU time (with --threads 1: what other load on
a shared host barely moves).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, TensorProto, helper, numpy_helper

from kiln.contract import OP_DOMAIN
from kiln.gguf_blocks import GgmlType, random_blocks
from kiln.matmul_q4_1 import Q4_1Weights
from kiln.moe import OP_TYPE, OP_VERSION, pack_q4_1_experts
from kiln.moe_gguf import TYPE_ATTRIBUTES, gguf_experts
from kiln.runtime.ort_runner import open_session


def random_q4_1(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q uint8 [..., K] and d, m float16 [..., K / 32] of a weight with entries ~ +-0.02."""
    q = rng.integers(0, 16, size=shape, dtype=np.uint8)
    blocks = (*shape[:-1], shape[-1] // 32)
    return q, np.full(blocks, 0.003, np.float16), np.full(blocks, -0.0225, np.float16)


def model(nodes: list, inits: list, hidden: int) -> ModelProto:
    g = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", hidden])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", hidden])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(OP_DOMAIN, OP_VERSION)])
    m.ir_version = 8
    return m


def moe_model(rng: np.random.Generator, args: argparse.Namespace) -> ModelProto:
    e, d, f = args.experts, args.hidden, args.expert_width
    gate_up, gate_up_dm = pack_q4_1_experts(*random_q4_1(rng, (e, 2 * f, d)))
    down, down_dm = pack_q4_1_experts(*random_q4_1(rng, (e, d, f)))
    router = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    arrays = {"router": router, "gate_up": gate_up, "down": down, "gate_up_dm": gate_up_dm, "down_dm": down_dm}
    node = helper.make_node(OP_TYPE, ["x", *arrays], ["y"], domain=OP_DOMAIN, top_k=args.top_k, norm_topk_prob=1)
    return model([node], [numpy_helper.from_array(a, name) for name, a in arrays.items()], d)


def gguf_moe_model(rng: np.random.Generator, args: argparse.Namespace) -> ModelProto:
    e, d, f = args.experts, args.hidden, args.expert_width
    kinds = [GgmlType[name] for name in args.gguf_experts]
    stacks = [random_blocks(rng, kind, e * rows, k, 0.02).reshape(e, rows, -1)
              for kind, rows, k in zip(kinds, (f, f, d), (d, d, f), strict=True)]
    experts = gguf_experts(*stacks, tuple(kinds))
    router = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    arrays = {"router": router, "gate_up": experts.gate_up, "down": experts.down}
    node = helper.make_node(OP_TYPE, ["x", *arrays], ["y"], domain=OP_DOMAIN, top_k=args.top_k, norm_topk_prob=1)
    node.attribute.extend(helper.make_attribute(name, int(k)) for name, k in zip(TYPE_ATTRIBUTES, kinds, strict=True))
    return model([node], [numpy_helper.from_array(a, name) for name, a in arrays.items()], d)


def dense_model(rng: np.random.Generator, args: argparse.Namespace) -> ModelProto:
    d, f = args.hidden, args.expert_width * args.top_k
    inits, nodes = [], []
    for name, (n, k), x, y in (("gate_up", (2 * f, d), "x", "h"), ("down", (d, f), "a", "y")):
        qs, dm = Q4_1Weights(*random_q4_1(rng, (n, k))).pack()
        inits += [numpy_helper.from_array(qs, f"{name}.qs"), numpy_helper.from_array(dm, f"{name}.dm")]
        nodes.append(helper.make_node("MatMulQ4_1", [x, f"{name}.qs", f"{name}.dm"], [y], domain=OP_DOMAIN))
    nodes.insert(1, helper.make_node("SwiGLU", ["h"], ["a"], domain=OP_DOMAIN))
    return model(nodes, inits, d)


def ms_per_run(sess: ort.InferenceSession, x: np.ndarray, repeats: int, clock=time.perf_counter) -> float:
    sess.run(None, {"x": x})
    start = clock()
    for _ in range(repeats):
        sess.run(None, {"x": x})
    return (clock() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-width", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf-experts", nargs=3, metavar=("GATE", "UP", "DOWN"),
                        choices=[k.name for k in GgmlType], help="compare GGUF experts of these types with Q4_1 ones")
    parser.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time")
    parser.add_argument("--baseline-library", help="an older libkiln_ops.so: the first graph also on it, each round")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    names: tuple[str, ...]
    if args.gguf_experts:
        names = ("GGUF", "Q4_1")
        first, second = gguf_moe_model(rng, args), moe_model(rng, args)
        print(f"D={args.hidden} experts={args.experts}x{args.expert_width} top-{args.top_k}; GGUF experts "
              f"{'/'.join(args.gguf_experts)} against Q4_1 experts; {args.threads} threads; ms per layer "
              f"(median of {args.rounds} rounds)")
    else:
        names = ("MoE", "dense")
        first, second = moe_model(rng, args), dense_model(rng, args)
        print(f"D={args.hidden} experts={args.experts}x{args.expert_width} top-{args.top_k}; dense width "
              f"{args.top_k * args.expert_width}; {args.threads} threads; ms per layer "
              f"(median of {args.rounds} rounds)")
    sessions = [open_session(graph.SerializeToString(), args.threads) for graph in (first, second)]
    if args.baseline_library:
        names += (names[0] + "@old",)
        sessions.append(open_session(first.SerializeToString(), args.threads, args.baseline_library))
    clock = time.process_time if args.cpu_time else time.perf_counter
    ratio_title = f"{names[0]}/{names[1]} [min-max over rounds]"
    old_title = f"  {names[0]}/{names[0]}@old [min-max]" if args.baseline_library else ""
    print(f"{'rows':>5} " + " ".join(f"{name:>8}" for name in names) + f" {ratio_title:>32}{old_title}")
    for rows in args.rows:
        x = rng.standard_normal((rows, args.hidden)).astype(np.float32)
        repeats = max(3, 64 // rows)
        times: list[list[float]] = [[] for _ in sessions]
        for _ in range(args.rounds):
            for sess, timed in zip(sessions, times, strict=True):
                timed.append(ms_per_run(sess, x, repeats, clock))
        medians = " ".join(f"{statistics.median(timed):>8.2f}" for timed in times)
        line = f"{rows:>5} {medians} {ratio_cell(times[0], times[1]):>32}"
        if args.baseline_library:
            line += f"  {ratio_cell(times[0], times[2])}"
        print(line)


def ratio_cell(a: list[float], b: list[float]) -> str:
    """The median of the rounds' ratios a / b and their range."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


if __name__ == "__main__":
    main()
