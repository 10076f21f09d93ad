"""What structured output costs an engine: a decode step of ROWS sequences with a JSON schema on every row against
the same step without one, and the time to first token of a request with a 30-property schema (the engine's first
structured request; first use of a schema; a cached one) against none.

    python benchmarks/bench_structured.py ENGINE_DIR [--rows 16] [--rounds 5]

Step times are medians over the steps where all rows decode, in interleaved rounds (the machine drifts); the mask's
own parts (llguidance's fill, the op library's apply) are timed inside the constrained steps, with the fill done
after the model step (inline) and during it (overlapped, the engine's default).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kiln.runtime.llm import LLM
from kiln.runtime.params import SamplingParams
from kiln.runtime.structured import StructuredOutput
from kiln.runtime.structured.grammar import MaskStep

PROMPT = "Describe a fictional person as JSON, with every field filled in:"


def wide_schema(properties: int) -> dict[str, object]:
    kinds = [{"type": "string", "maxLength": 12}, {"type": "integer"}, {"type": "boolean"},
             {"enum": ["red", "green", "blue"]}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


class MaskTimer:
    """While entered, wraps MaskStep.bitmask (the fill, on whichever thread) and MaskStep.apply (what the sampler
    waits) to add up their seconds."""

    def __init__(self) -> None:
        self.fill = self.total = 0.0
        self.calls = 0
        self._saved = (MaskStep.bitmask, MaskStep.apply)

    def __enter__(self) -> MaskTimer:
        bitmask, apply = self._saved

        def timed_bitmask(step, states, vocab):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return bitmask(step, states, vocab)
            finally:
                self.fill += time.perf_counter() - start

        def timed_apply(step, logits, states):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return apply(step, logits, states)
            finally:
                self.total += time.perf_counter() - start
                self.calls += 1

        MaskStep.bitmask, MaskStep.apply = timed_bitmask, timed_apply  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        MaskStep.bitmask, MaskStep.apply = self._saved  # type: ignore[method-assign]


def decode_steps(llm: LLM, rows: int, params: SamplingParams) -> list[float]:
    """Seconds of each step in which every one of `rows` sequences decodes."""
    engine = llm.engine
    for i in range(rows):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", f"{PROMPT} (#{i})", params)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        running = engine.scheduler.running
        if len(running) == rows and all(s.num_output_tokens > 1 for s in running):
            times.append(elapsed)
    return times


def first_token(llm: LLM, params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(PROMPT, params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(args.engine)  # builds llguidance's tokenizer while the model opens
    load_s = time.perf_counter() - start
    schema = StructuredOutput.json_schema(wide_schema(30))
    plain = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.tokens, structured=schema)

    # the engine's first structured request, after one plain one (onnxruntime's own first-run cost); its own
    # work (the spec checked and compiled, its first mask) timed inside it
    first_plain = first_token(llm, SamplingParams(temperature=0, max_tokens=1))
    compile_s = [0.0]
    compile_ = llm.engine._compile

    def timed_compile(spec):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return compile_(spec)
        finally:
            compile_s[0] += time.perf_counter() - start

    llm.engine._compile = timed_compile  # type: ignore[method-assign]
    with MaskTimer() as first_mask:
        start = time.perf_counter()
        first_spec = StructuredOutput.json_schema({**wide_schema(30), "description": "first"})
        spec_s = time.perf_counter() - start
        first_structured = first_token(llm, SamplingParams(temperature=0, max_tokens=1, structured=first_spec))
    llm.engine._compile = compile_  # type: ignore[method-assign]
    ttft: dict[str, list[float]] = {"none": [], "schema, first use": [], "schema, cached": []}
    for round_ in range(args.rounds):
        one = SamplingParams(temperature=0, max_tokens=1)
        ttft["none"].append(first_token(llm, one))
        fresh = StructuredOutput.json_schema({**wide_schema(30), "description": f"round {round_}"})  # uncached
        ttft["schema, first use"].append(first_token(llm, SamplingParams(temperature=0, max_tokens=1,
                                                                         structured=fresh)))
        ttft["schema, cached"].append(first_token(llm, SamplingParams(temperature=0, max_tokens=1,
                                                                      structured=schema)))

    timers = {overlap: MaskTimer() for overlap in (False, True)}
    steps: dict[str, list[float]] = {"none": [], "schema, inline": [], "schema, overlapped": []}
    masks = llm.engine.sampler.masks
    for _ in range(args.rounds):
        steps["none"] += decode_steps(llm, args.rows, plain)
        for overlap in (False, True):
            masks.overlap = overlap
            with timers[overlap]:
                steps["schema, overlapped" if overlap else "schema, inline"] += decode_steps(llm, args.rows,
                                                                                            constrained)
    base = statistics.median(steps["none"])
    print(f"engine load (llguidance's tokenizer built meanwhile): {load_s:.2f} s")
    print(f"the engine's first requests, TTFT: plain {first_plain * 1e3:.1f} ms, then a 30-property schema "
          f"{first_structured * 1e3:.1f} ms, of which its own work {(spec_s + compile_s[0]) * 1e3:.1f} ms "
          f"(spec checked and compiled) + {first_mask.total * 1e3:.1f} ms (its mask)")
    for name, values in ttft.items():
        print(f"TTFT, 1 output token, {name}: median {statistics.median(values) * 1e3:.1f} ms")
    print(f"{args.rows}-row decode step, no constraint: {base * 1e3:.2f} ms ({len(steps['none'])} steps)")
    for overlap in (False, True):
        name, timer = ("schema, overlapped" if overlap else "schema, inline"), timers[overlap]
        masked = statistics.median(steps[name])
        print(f"  JSON schema on every row, mask filled {'during the model step' if overlap else 'after it'}: "
              f"{masked * 1e3:.2f} ms = {masked / base:.3f}x ({len(steps[name])} steps); the sampler waits "
              f"{timer.total / timer.calls * 1e3:.2f} ms per step for the mask (llguidance fill "
              f"{timer.fill / timer.calls * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
