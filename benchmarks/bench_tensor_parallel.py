"""16-way decode: 2 tensor-parallel ranks x 1 thread against 1 process x 2 threads, on the same one-graph engine.

The engine (a float32 one-graph engine, e.g. SmolLM2's) is split into 2 ranks in a temporary directory
(split_engine_tensor_parallel); both are loaded once and measured in interleaved rounds (the host drifts): each
round prefills BATCH distinct prompts, then times DECODE greedy decode steps of all BATCH sequences together.
Reported per round and as medians: decode tokens per second of each, and for the ranks, over the decode steps,
each one's seconds and the share of them it waited in kiln.AllReduce, with the bytes reduced; and the load average
around the run (other work on the host shows there).

    python benchmarks/bench_tensor_parallel.py ENGINE_DIR [--rounds 3] [--batch 16] [--decode 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kiln.optimize.shard_tensor_parallel import split_engine_tensor_parallel
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig, SamplingParams

PROMPT_LEN = 32


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """Distinct fixed prompts (no shared prefix: every sequence computes its own)."""
    return [[(97 * i + 31 * j + 7) % (vocab - 100) + 50 for j in range(PROMPT_LEN)] for i in range(batch)]


def prefill(engine: Engine, batch: int, decode: int, tag: str) -> None:
    """Add `batch` requests of `decode` + 1 greedy tokens and step until every prompt is computed."""
    params = SamplingParams(temperature=0, max_tokens=decode + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts(batch, engine.runner.vocab_size)):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.scheduler.waiting or any(seq.num_computed_tokens < seq.num_prompt_tokens
                                          for seq in engine.scheduler.running):
        engine.step()


def decode_rate(engine: Engine) -> tuple[float, int]:
    """Decode tokens per second of the prefilled sequences until they finish; and the steps timed."""
    tokens, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(out.outputs[0].token_ids) for out in engine.step())
        steps += 1
    return tokens / (time.perf_counter() - start), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decode", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kiln-tp-bench-") as tmp:
        ranked = Path(tmp) / "tp2"
        split_engine_tensor_parallel(args.engine, ranked, 2)
        common = {"kv_cache_bytes": 256 << 20, "max_num_seqs": args.batch, "enable_prefix_caching": False}
        one = load_engine(args.engine, RuntimeConfig(num_threads=2, **common))
        tp = load_engine(ranked, RuntimeConfig(num_threads=1, tensor_parallel=2, **common))
        rounds: list[dict[str, Any]] = []
        try:
            for index in range(args.rounds):
                prefill(one, args.batch, args.decode, f"one{index}")
                one_rate, _ = decode_rate(one)
                prefill(tp, args.batch, args.decode, f"tp{index}")
                before = tp.stats().tensor_parallel
                tp_rate, steps = decode_rate(tp)
                after = tp.stats().tensor_parallel
                seconds = [a - b for a, b in zip(after.rank_seconds, before.rank_seconds, strict=True)]
                waits = [a - b for a, b in zip(after.wait_seconds, before.wait_seconds, strict=True)]
                rounds.append({"one_process_2_threads_tok_per_s": round(one_rate, 1),
                               "two_ranks_1_thread_tok_per_s": round(tp_rate, 1),
                               "rank_seconds": [round(s, 3) for s in seconds],
                               "all_reduce_wait_share": [round(w / s, 3) for w, s in zip(waits, seconds, strict=True)],
                               "all_reduce_bytes": after.all_reduce_bytes - before.all_reduce_bytes,
                               "decode_steps": steps})
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            tp.runner.close()
            one.runner.close()
    report = {
        "engine": str(args.engine), "batch": args.batch, "decode_steps": args.decode, "rounds": rounds,
        "median_one_process_2_threads_tok_per_s": statistics.median(r["one_process_2_threads_tok_per_s"]
                                                                    for r in rounds),
        "median_two_ranks_1_thread_tok_per_s": statistics.median(r["two_ranks_1_thread_tok_per_s"] for r in rounds),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": len(os.sched_getaffinity(0)),
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
