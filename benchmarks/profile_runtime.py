"""Where a decode step's time goes: the model (runner.execute) against the Python runtime around it.

Runs a real engine at batch 1 and batch 32 with greedy, temperature 1.0, top_p 0.9 and
top_k 50 + min_p 0.05 requests (128 tokens each, ignore_eos) and reports, per decode step
(steps where all the batch's sequences compute one token each), the mean model time and the
Python side broken down: schedule, build_batch, sample, detokenize (incremental text and
stop strings), outputs (the delta RequestOutputs) and the rest of postprocess (scheduler
update, appending tokens, stop checks). The runtime's share is Python / (model + Python).
The absolute Python milliseconds do not depend on the engine's weights; the share does.

    python benchmarks/profile_runtime.py ENGINE_DIR [--batches 1 32] [--max-tokens 128] [--threads 2]
        [--clock cpu]

--clock cpu times with the process's CPU time instead of the wall clock: with --threads 1 the model
and the Python side then run on one thread and a busy shared machine's preemption stays out of both.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime import detokenizer, engine
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.model_runner import RunnerOutput, build_batch
from kiln.runtime.params import RuntimeConfig, SamplingParams

KINDS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "top_k 50 + min_p 0.05": {"temperature": 1.0, "top_k": 50, "min_p": 0.05},
}
TOPICS = ["a lighthouse", "the moon", "bread", "a river", "chess", "winter", "a robot", "the ocean"]
PARTS = ("schedule", "build_batch", "sample", "detokenize", "outputs", "postprocess other")


@dataclass
class StepTimes:
    """Seconds spent in each part over the decode steps measured so far."""

    model: float = 0.0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    steps: int = 0


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@contextmanager
def timed_method(owner: type, name: str, sink: dict[str, float], part: str,
                 clock: Callable[[], float]) -> Iterator[None]:
    """Wrap owner.name so its time accumulates in sink[part] (the profiler's own hook, undone on exit)."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            sink[part] += clock() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def run_batch(llm_engine: Engine, batch: int, params: SamplingParams, clock: Callable[[], float]) -> StepTimes:
    """Generate batch requests together, timing every step's parts; only pure decode steps count."""
    tok = llm_engine.tokenizer
    for i in range(batch):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Write a short story about {TOPICS[i % 8]}."}])
        llm_engine.add_request(f"profile-{batch}-{i}", prompt, params)
    totals = StepTimes()
    step_parts = dict.fromkeys(PARTS, 0.0)
    with (timed_method(type(llm_engine.sampler), "__call__", step_parts, "sample", clock),
          timed_method(detokenizer.IncrementalDetokenizer, "add", step_parts, "detokenize", clock),
          timed_method(detokenizer.IncrementalDetokenizer, "find_stop", step_parts, "detokenize", clock),
          timed_method(engine.Request, "take_output", step_parts, "outputs", clock)):
        while llm_engine.has_unfinished():
            step_parts.update(dict.fromkeys(PARTS, 0.0))
            t0 = clock()
            out = llm_engine.scheduler.schedule()
            t1 = clock()
            batch_input = build_batch(out)
            t2 = clock()
            logits = llm_engine.runner.execute(batch_input)
            t3 = clock()
            llm_engine._postprocess(out, RunnerOutput(logits), None)
            t4 = clock()
            if not out.num_tokens == len(out.scheduled) == batch:
                continue  # a prefill step, or one while later prompts still prefill (the CPU step budget)
            totals.steps += 1
            totals.model += t3 - t2
            inner = step_parts["sample"] + step_parts["detokenize"] + step_parts["outputs"]
            step_parts.update({"schedule": t1 - t0, "build_batch": t2 - t1, "postprocess other": t4 - t3 - inner})
            for part, seconds in step_parts.items():
                totals.parts[part] += seconds
    return totals


def report(kind: str, batch: int, times: StepTimes) -> str:
    per_step = 1e3 / max(times.steps, 1)
    python = sum(times.parts.values()) * per_step
    model = times.model * per_step
    parts = " | ".join(f"{times.parts[p] * per_step:>{len(p)}.2f}" for p in PARTS)
    return (f"| {kind:<22} | {batch:>5} | {model:8.1f} | {python:7.2f} | {100 * python / (model + python):5.1f}% "
            f"| {parts} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    args = parser.parse_args()
    llm_engine = load_engine(args.engine_dir, RuntimeConfig(max_num_seqs=max(args.batches), num_threads=args.threads))
    header = " | ".join(PARTS)
    print(f"per decode step, ms of {args.clock} time (engine {args.engine_dir}, {args.threads} threads, "
          f"{args.max_tokens} tokens)")
    print(f"| {'requests':<22} | batch | model ms | Python ms | share | {header} |")
    for batch in args.batches:
        for kind in args.kinds:
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **KINDS[kind])
            print(report(kind, batch, run_batch(llm_engine, batch, params, CLOCKS[args.clock])), flush=True)


if __name__ == "__main__":
    main()
