"""kiln's offline figures, driven in-process through kiln.runtime's Engine as a user's program would."""

from __future__ import annotations

import time
from pathlib import Path

from workload import Workload

from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig, SamplingParams


def timed_generation(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """All prompts at once, exactly output_len greedy tokens each. Decode rate: the tokens emitted after the
    last request's first token over the time from then to the end (the step budget may finish prompts a few
    steps apart: tokens decoded before the last prompt finished are not counted); aggregate: all tokens over
    all time."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"peers-{i}", prompt, params)
    first: dict[str, float] = {}
    emitted: list[tuple[float, int]] = []  # (when, tokens) per step
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
        emitted.append((now, sum(len(out.outputs[0].token_ids) for out in outputs)))
    end = time.perf_counter()
    all_started = max(first.values())
    return {
        "prefill_s": min(first.values()) - start,
        "decode_tok_per_s": sum(n for when, n in emitted if when > all_started) / (end - all_started),
        "aggregate_tok_per_s": len(prompts) * output_len / (end - start),
    }


def measure(engine_dir: Path, work: Workload, threads: int) -> dict[str, float]:
    """The figures, keyed as report.Figure keys."""
    engine = load_engine(engine_dir, RuntimeConfig(num_threads=threads, enable_prefix_caching=False))
    try:
        timed_generation(engine, [work.single_prompt], 8)  # warm-up
        prefill = timed_generation(engine, [work.prefill_prompt], 2)
        single = timed_generation(engine, [work.single_prompt], work.output_len)
        figures = {"prefill_512": len(work.prefill_prompt) / prefill["prefill_s"],
                   "decode_1": single["decode_tok_per_s"]}
        for size, prompts in work.batches.items():
            run = timed_generation(engine, prompts, work.output_len)
            figures[f"batch{size}_aggregate"] = run["aggregate_tok_per_s"]
            figures[f"batch{size}_decode"] = run["decode_tok_per_s"]
        return figures
    finally:
        engine.runner.close()
