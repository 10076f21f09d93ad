"""Single-stream decode steps of two or more engines (or op libraries) alternated step by step in one process.

    python benchmarks/alternate_steps.py ENGINE[:LIBRARY] ENGINE[:LIBRARY] ... [--steps 150] [--threads 2]

Each ENGINE gets its own session (with LIBRARY, another build of libkiln_ops.so, when given) and one greedy request;
after a few warm-up steps the engines take one decode step each, in turn, the order reversed every step, and each
step's model run (`execute_all`) is timed. A host whose memory bandwidth drifts by 1.5x within minutes moves both
sides of every pair alike, so the per-step ratio against the first engine is the figure to read; the medians are
printed too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def summary(names: list[str], times: list[list[float]]) -> list[str]:
    """One line an engine: median and fastest step (ms), its median against the first's, and the median of its
    step-by-step ratios to the first's steps."""
    lines = []
    base = statistics.median(times[0])
    for name, steps in zip(names, times, strict=True):
        ratios = [t / b for t, b in zip(steps, times[0], strict=True)]
        lines.append(f"{name}: median {statistics.median(steps) * 1e3:.2f} ms, fastest {min(steps) * 1e3:.2f} ms, "
                     f"{statistics.median(steps) / base:.3f}x the first's median, per-step ratio "
                     f"{statistics.median(ratios):.3f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="+", help="ENGINE_DIR or ENGINE_DIR:LIBRARY")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from kiln.runtime.loader import load_engine
    from kiln.runtime.model_runner import build_batch
    from kiln.runtime.ort_runner import OrtModelRunner, graph_kv_pools, open_session
    from kiln.runtime.params import RuntimeConfig, SamplingParams

    engines = []
    for spec in args.engines:
        directory, _, library = spec.partition(":")
        engine = load_engine(Path(directory), RuntimeConfig(max_num_seqs=1, num_threads=args.threads,
                                                             enable_prefix_caching=False))
        if library:  # the runtime's own session, another op library
            session = open_session(Path(directory) / "model.onnx", args.threads, library)
            engine.runner = OrtModelRunner(session, graph_kv_pools(session), engine.runner.num_blocks)
        engine.add_request("alternate", list(range(100, 116)),
                           SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0.0))
        engines.append(engine)

    def step(engine) -> float:
        out = engine.scheduler.schedule()
        start = time.perf_counter()
        result = engine.runner.execute_all(build_batch(out))
        seconds = time.perf_counter() - start
        engine._postprocess(out, result)
        return seconds

    for engine in engines:  # the prefill and the first decode steps
        for _ in range(4):
            step(engine)
    times: list[list[float]] = [[] for _ in engines]
    for i in range(args.steps):
        order = range(len(engines)) if i % 2 == 0 else reversed(range(len(engines)))
        for j in order:
            times[j].append(step(engines[j]))
    print("\n".join(summary(args.engines, times)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
