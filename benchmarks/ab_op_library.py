"""Paired A/B of model-step time under several builds of the op library, or of the engine, in one process.

This machine's speed drifts 10-30% within minutes, so two builds timed one after the other differ by more
than most kernel changes do. Here every build gets its own ONNX Runtime session of the same engine graph,
and the sessions take turns: a block of steps on the first build, then on the second, ..., repeated. A
block is a few milliseconds to a few hundred, so a drift hits neighbouring blocks alike, and each block
is compared with the first build's block of the same round. Prints, per build, the median block time and
the median (and range) of its ratio to the first build. List the first build twice for an A/A run: the
ratio's range is then this run's noise.

The step is the model alone (OrtModelRunner.execute, no scheduler or sampler): `--batch` sequences
decoding one token each after a 37-token prompt, or with `--chunk N` one sequence computing an N-token
prompt chunk. A short sleep before each block lets the previous session's pool threads stop spinning.

    python benchmarks/ab_op_library.py ENGINE_DIR LIB_A.so LIB_B.so [...] [--batch 1] [--chunk 0]
        [--threads 2] [--blocks 40] [--steps 16]

LIB: a libkiln_ops*.so, e.g. runtime/ops/libkiln_ops_avx512vnni.so copied aside before a change, and the
rebuilt one. `--engines DIR ...` adds sessions of other engine directories (the same inputs: e.g. the engine
with one graph constant changed) on `--engines-library` (default: the first library), compared with the
first session like the others.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.runtime.model_runner import Chunk, pack_chunks
from kiln.runtime.ort_runner import OrtModelRunner, graph_kv_pools

PROMPT_TOKENS = 37  # the peer benchmark's chat prompt length
BLOCKS_PER_SEQUENCE = 16
PAUSE_S = 0.03  # before each block: long enough for the other sessions' pool threads to stop spinning


def runner(engine_dir: Path, library: str, threads: int, num_blocks: int) -> OrtModelRunner:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(engine_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return OrtModelRunner(session, graph_kv_pools(session), num_blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("libraries", nargs="+", help="op library builds; the first is the baseline")
    parser.add_argument("--engines", type=Path, nargs="*", default=[],
                        help="other engine dirs, each also measured on --engines-library")
    parser.add_argument("--engines-library", help="the op library of --engines (default: the first library)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding one token each a step")
    parser.add_argument("--chunk", type=int, default=0, help="instead: one sequence's prompt chunk of N tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=40, help="rounds; each build runs one block a round")
    parser.add_argument("--steps", type=int, default=16, help="steps a block (its median is the block's time)")
    args = parser.parse_args()
    engines_library = args.engines_library or args.libraries[0]
    builds = [(args.engine_dir, lib) for lib in args.libraries] + [(d, engines_library) for d in args.engines]
    if len(builds) < 2:
        parser.error("give at least two builds (the same one twice measures the noise)")
    num_sequences = max(args.batch, 1)
    runners = [runner(engine, lib, args.threads, num_sequences * BLOCKS_PER_SEQUENCE) for engine, lib in builds]
    span = BLOCKS_PER_SEQUENCE * runners[0].block_size  # tokens a sequence's block table holds
    if args.chunk > span or PROMPT_TOKENS + args.steps > span:
        parser.error(f"--chunk and {PROMPT_TOKENS} + --steps must fit the {span} tokens of a sequence's blocks")
    tables = [list(range(i * BLOCKS_PER_SEQUENCE, (i + 1) * BLOCKS_PER_SEQUENCE)) for i in range(num_sequences)]
    rng = np.random.default_rng(0)
    for r in runners:  # every session computes the same prompts once, so decode steps read a real context
        for table in tables:
            r.execute(pack_chunks([Chunk(0, rng.integers(100, 5000, PROMPT_TOKENS).tolist(), table)], False))

    def batch(step: int):
        if args.chunk:
            return pack_chunks([Chunk(0, rng.integers(100, 5000, args.chunk).tolist(), tables[0])], False)
        return pack_chunks([Chunk(PROMPT_TOKENS + step, [int(rng.integers(100, 5000))], table) for table in tables],
                           False)

    blocks: list[list[float]] = [[] for _ in runners]
    for _ in range(args.blocks):
        for k, r in enumerate(runners):
            time.sleep(PAUSE_S)
            times = []
            for step in range(args.steps):
                b = batch(step)
                start = time.perf_counter()
                r.execute(b)
                times.append(time.perf_counter() - start)
            blocks[k].append(statistics.median(times) * 1e3)
    what = f"chunk of {args.chunk} tokens" if args.chunk else f"decode step, batch {args.batch}"
    print(f"{what}, {args.threads} threads, {args.blocks} rounds of {args.steps} steps ({args.engine_dir})")
    for k, (engine, lib) in enumerate(builds):
        ratios = [t / base for t, base in zip(blocks[k], blocks[0], strict=True)]
        print(f"  {engine if engine != args.engine_dir else lib}: median block {statistics.median(blocks[k]):.2f} ms "
              f"[{min(blocks[k]):.2f}-{max(blocks[k]):.2f}], vs the first {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
