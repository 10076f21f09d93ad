"""What a pipeline costs on one machine: 16-way decode of one engine as one graph on 2 threads against its
2-stage copy with 1 thread per stage, in this process (`local`; `local-2x1-micro2`: two micro-batches taking
turns, what splitting a step costs) and in two Ray actors (`ray`, what
`kiln serve --pipeline-parallel 2` runs) with each step whole (`micro1`: the stages take turns) and in two
micro-batches in flight (`micro2`, the default: the stages overlap), in interleaved rounds.

Each layout loads its engine, prefills 16 prompts of 16 tokens, then decodes 32 tokens each in 16-row steps;
reported per layout and round: decode tok/s (wall, after every prompt's first token), the stages' shares of
their compute time, their compute time over wall time (above 1: stages overlapped), micro-batches per step, the
hidden-state bytes handed on per token, and the host's load average when the run ended.

    python benchmarks/bench_pipeline.py ENGINE_DIR [--rounds 2]     (ENGINE_DIR: a one-graph engine)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kiln.optimize.split_stages import split_engine
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig, SamplingParams

SEQS, PROMPT, NEW = 16, 16, 32


def decode_run(engine_dir: Path, config: RuntimeConfig) -> dict[str, Any]:
    engine = load_engine(engine_dir, config)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i in range(SEQS):
        engine.add_request(str(i), rng.integers(100, 40000, PROMPT).tolist(), params)
    while engine.stats().num_generated_tokens < SEQS:  # every prompt prefilled, first tokens out
        engine.step()
    before, start = engine.stats(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed, after = time.perf_counter() - start, engine.stats()
    pipeline = getattr(engine.runner, "stats", None)
    engine.runner.close()
    result: dict[str, Any] = {"decode_tok_per_s": round((after.num_generated_tokens - before.num_generated_tokens)
                                                        / elapsed, 1)}
    if after.pipeline.stage_seconds:
        seconds = [a - b for a, b in zip(after.pipeline.stage_seconds, before.pipeline.stage_seconds, strict=True)]
        tokens = after.pipeline.tokens - before.pipeline.tokens
        result["stage_share"] = [round(s / sum(seconds), 3) for s in seconds]
        result["stage_busy"] = round(sum(seconds) / elapsed, 3)  # compute time over wall time, all stages
        result["bytes_per_token"] = (after.pipeline.bytes_moved - before.pipeline.bytes_moved) / tokens
    if pipeline is not None:
        result["micro_batches_per_step"] = round(pipeline.micro_batches / pipeline.steps, 2)
    result["loadavg_1m"] = float(Path("/proc/loadavg").read_text().split()[0])
    return result


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "staged"
        split_engine(args.engine, staged, 2)
        layouts = {
            "one-graph-2-threads": (args.engine, RuntimeConfig(num_threads=2, kv_cache_bytes=64 << 20)),
            "local-2x1": (staged, RuntimeConfig(num_threads=1, kv_cache_bytes=64 << 20)),
            # two micro-batches taking turns: what the smaller matmuls cost, without Ray and without overlap
            "local-2x1-micro2": (staged, RuntimeConfig(num_threads=1, kv_cache_bytes=64 << 20,
                                                       pipeline_micro_batches=2)),
            "ray-2x1-micro1": (staged, RuntimeConfig(num_threads=1, kv_cache_bytes=64 << 20, pipeline_parallel=2,
                                                     pipeline_micro_batches=1)),
            "ray-2x1-micro2": (staged, RuntimeConfig(num_threads=1, kv_cache_bytes=64 << 20, pipeline_parallel=2)),
        }
        rounds = []
        for index in range(args.rounds):
            for name, (engine, config) in layouts.items():
                result = {"round": index, "layout": name, **decode_run(engine, config)}
                print(json.dumps(result), flush=True)
                rounds.append(result)
    print(json.dumps({"host": cpu_model(), "cpus": os.cpu_count(), "runs": rounds}))


if __name__ == "__main__":
    main()
