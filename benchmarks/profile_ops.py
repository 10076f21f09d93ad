"""Where a decode step's model time goes: ONNX Runtime's own profile, summed per op type.

Loads an engine, swaps its runner for one whose session has ORT profiling on (optionally with
another build of the op library, e.g. main's, for a before/after), generates `batch` greedy
requests of --max-tokens tokens (ignore_eos) for each batch size, and takes each node's fastest
kernel time over the pure decode steps (all `batch` sequences compute one token each; prefill runs
are left out; decode steps repeat the same work, and a busy machine's preemption only ever adds
time), summed per op type. Prints, per batch size, ms per decode step and each op type's share.

    python benchmarks/profile_ops.py ENGINE_DIR [--batches 1 32] [--max-tokens 64] [--threads 1]
        [--library OTHER/libkiln_ops.so] [--stat min|median]

An `If` node's time (the int4-rescored head's switch) includes its branch's nodes, which are listed too.

With --threads 1 a node's fastest time is close to its CPU time even on a busy machine (a median
would not be: at a load of 8 per core a 10 ms node is preempted in most steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import onnxruntime as ort

from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.model_runner import RunnerOutput, build_batch
from kiln.runtime.ops import library_path
from kiln.runtime.ort_runner import OrtModelRunner, graph_kv_pools
from kiln.runtime.params import RuntimeConfig, SamplingParams

TOPICS = ["a lighthouse", "the moon", "bread", "a river", "chess", "winter", "a robot", "the ocean"]


def profiled_runner(engine_dir: Path, threads: int, num_blocks: int, library: str, prefix: str) -> OrtModelRunner:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    options.log_severity_level = 3
    session = ort.InferenceSession(str(engine_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return OrtModelRunner(session, graph_kv_pools(session), num_blocks)


def generate(llm_engine: Engine, batch: int, max_tokens: int) -> list[bool]:
    """Runs batch greedy requests to the end; per model run, whether it was a pure decode step."""
    tok = llm_engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Write a short story about {TOPICS[i % 8]}."}])
        llm_engine.add_request(f"ops-{batch}-{i}", prompt, params)
    decode_runs = []
    while llm_engine.has_unfinished():
        out = llm_engine.scheduler.schedule()
        if not out:
            raise RuntimeError("nothing could be scheduled: the KV pool is too small for the batch")
        # the whole batch decoding: with a CPU step budget the first prompts decode while later ones prefill
        decode_runs.append(out.num_tokens == len(out.scheduled) == batch)
        llm_engine._postprocess(out, RunnerOutput(llm_engine.runner.execute(build_batch(out))), None)
    return decode_runs


def op_times(profile: Path, decode: list[bool], stat: str = "min") -> tuple[dict[str, float], int, float]:
    """Per op type, the sum of its nodes' fastest (stat "min") or median kernel microseconds over the decode
    runs; the number of those runs; and their median wall microseconds (the whole model run)."""
    events = json.loads(profile.read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    if len(runs) != len(decode):
        raise RuntimeError(f"the profile holds {len(runs)} model runs, the generation made {len(decode)}")
    windows = [(r["ts"], r["ts"] + r["dur"]) for r, is_decode in zip(runs, decode, strict=True) if is_decode]
    per_node: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if any(start <= e["ts"] <= end for start, end in windows):
            per_node[(e["args"]["op_name"], e["name"])].append(e["dur"])
    totals: dict[str, float] = defaultdict(float)
    for (op, _), durations in per_node.items():
        totals[op] += min(durations) if stat == "min" else statistics.median(durations)
    run_median = statistics.median(end - start for start, end in windows) if windows else 0.0
    return totals, len(windows), run_median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--library", default=None, help="the libkiln_ops.so to profile (default: this install's)")
    parser.add_argument("--stat", choices=["min", "median"], default="min",
                        help="each node's fastest time (robust on one thread) or its median (what two threads see)")
    args = parser.parse_args()
    for batch in args.batches:
        llm_engine = load_engine(args.engine_dir, RuntimeConfig(max_num_seqs=batch, num_threads=args.threads))
        with tempfile.TemporaryDirectory(prefix="kiln-ops-") as tmp:
            runner = profiled_runner(args.engine_dir, args.threads, llm_engine.runner.num_blocks,
                                     args.library or library_path(), str(Path(tmp) / "ort"))
            llm_engine.runner = runner
            decode = generate(llm_engine, batch, args.max_tokens)
            totals, steps, run_median = op_times(Path(runner.session.end_profiling()), decode, args.stat)
        kernel = sum(totals.values())
        which = "fastest" if args.stat == "min" else "median"
        print(f"batch {batch}: {kernel / 1e3:.2f} ms of kernels per decode step ({which} of {steps} steps, "
              f"{args.threads} threads); a model run's median {run_median / 1e3:.2f} ms")
        print("| op type | ms / step | share |")
        print("|---|---|---|")
        for op, us in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"| {op} | {us / 1e3:.3f} | {100 * us / kernel:.1f}% |")


if __name__ == "__main__":
    main()
