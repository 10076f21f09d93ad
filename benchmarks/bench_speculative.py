"""Speculative decoding against plain decoding on one engine, in one run, interleaved.

Workload (`--workload`): `grounded`, input-grounded chat requests (rewrite, quote or summarise a given
passage; edit given code), or `open`, open chat questions (the Medusa training's held-out CHAT_QUESTIONS,
never trained on); greedy, max_tokens tokens each. Two measurements, each repeated `--rounds` times with the
methods interleaved (the machine is shared and drifts, so only ratios within a round mean much):

- single stream: one request at a time; decode tokens/s = (tokens - 1) / (time from the first
  token to the last), so prefill is not counted.
- aggregate: `--concurrency` requests at once (the workload cycled); output tokens / total time.

Time is the process's CPU time with one ONNX Runtime thread by default (`--clock cpu`; steadier than
wall time on a loaded machine), or wall time (`--clock wall`, with `--threads`).

    python benchmarks/bench_speculative.py ENGINE_DIR [--draft DRAFT_DIR] [--medusa [--medusa-rows 1 2]]
        [--workload open] [--no-ngram] [--num-tokens 1 2 3] [--rounds 3]

--medusa (an engine built with --medusa) adds the Medusa proposer with its heads read at every verified row,
and one more method per --medusa-rows N: heads read at no more than the first N verified rows. Several
--num-tokens values measure every speculative method at each k (named METHOD-kK), all in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig, SamplingParams, SpeculativeConfig
from kiln.runtime.speculative.medusa import MedusaProposer

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers had climbed "
    "the same one hundred and twelve steps each evening to light the lamp. The last keeper, a quiet man named "
    "Elias Marsh, kept a logbook in which he recorded the weather, the ships that passed, and the birds that "
    "rested on the gallery rail. When the light was automated in 1987, he left the logbook on the desk in the "
    "watch room, open to a page that read only: calm sea, light wind from the west, all well."
)
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
TASKS = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the following passage in the present tense:\n\n{PASSAGE}",
    f"Quote the first two sentences of this passage:\n\n{PASSAGE}",
    f"Summarise this passage, quoting its key phrases:\n\n{PASSAGE}",
    f"Rename the parameter `items` to `products` in this code and show the whole code:\n\n{CODE}",
    f"Add a docstring to each function in this code and show the whole code:\n\n{CODE}",
    f"Rewrite this code to use the `sum` builtin where it can, and show the whole code:\n\n{CODE}",
    f"Copy this code and add type hints to it:\n\n{CODE}",
]


def clock(kind: str) -> Callable[[], float]:
    return time.process_time if kind == "cpu" else time.perf_counter


def open_questions() -> list[str]:
    from kiln.heads.medusa_data import CHAT_QUESTIONS

    return list(CHAT_QUESTIONS[::3])  # 8 of the 24


def prompts(engine: Engine, tasks: list[str]) -> list[list[int]]:
    return [engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": t}]))
            for t in tasks]


def single_stream(engine: Engine, ids: list[list[int]], params: SamplingParams, now: Callable[[], float]
                  ) -> tuple[int, float]:
    """Decode tokens (after each request's first) and the time they took, one request at a time."""
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(ids):
        engine.add_request(f"s{i}", prompt, params)
        first, count = None, 0
        while engine.has_unfinished():
            for out in engine.step():
                count += len(out.outputs[0].token_ids)
                if first is None and count:
                    first, count = now(), count - 1
        assert first is not None
        tokens += count
        seconds += now() - first
    return tokens, seconds


def aggregate(engine: Engine, ids: list[list[int]], params: SamplingParams, concurrency: int,
              now: Callable[[], float]) -> tuple[int, float]:
    """Output tokens and time for `concurrency` requests submitted at once (the workload cycled)."""
    start, tokens = now(), 0
    for i in range(concurrency):
        engine.add_request(f"a{i}", ids[i % len(ids)], params)
    while engine.has_unfinished():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step())
    return tokens, now() - start


def spec_summary(engine: Engine, before: tuple[int, int, int]) -> dict[str, float]:
    s = engine.stats()
    v = s.num_spec_verifications - before[0]
    proposed, accepted = s.num_spec_proposed_tokens - before[1], s.num_spec_accepted_tokens - before[2]
    return {"verifications": v, "acceptance_rate": accepted / proposed if proposed else 0.0,
            "tokens_per_verification": 1 + accepted / v if v else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", type=Path)
    parser.add_argument("--draft", type=Path, default=None, help="also measure this draft engine")
    parser.add_argument("--medusa", action="store_true", help="also measure the engine's Medusa heads")
    parser.add_argument("--medusa-rows", type=int, nargs="*", default=[],
                        help="Medusa variants reading the heads at no more than N verified rows")
    parser.add_argument("--min-guess-probability", type=float, nargs="*", default=[],
                        help="Medusa variants proposing a chain only as far as its heads' probability stays >= P")
    parser.add_argument("--no-ngram", action="store_true", help="leave the n-gram proposer out")
    parser.add_argument("--workload", choices=["grounded", "open"], default="grounded")
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[4],
                        help="proposals per step; several values measure each method at each k, interleaved")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-aggregate", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    now = clock(args.clock)
    methods: dict[str, SpeculativeConfig | None] = {"plain": None}
    medusa_rows: dict[str, int | None] = {}  # method -> most verified rows whose heads are read (None: all)
    for k in args.num_tokens:
        tag = f"-k{k}" if len(args.num_tokens) > 1 else ""
        if not args.no_ngram:
            methods[f"ngram{tag}"] = SpeculativeConfig("ngram", num_tokens=k)
        if args.draft:
            methods[f"draft{tag}"] = SpeculativeConfig("draft", num_tokens=k, draft_engine=str(args.draft))
        if args.medusa:
            methods[f"medusa{tag}"] = SpeculativeConfig("medusa", num_tokens=k)
            medusa_rows[f"medusa{tag}"] = None  # every verified row (the proposer's default reads the first only)
            for rows in args.medusa_rows:
                methods[f"medusa{tag}-r{rows}"] = methods[f"medusa{tag}"]
                medusa_rows[f"medusa{tag}-r{rows}"] = rows
            for p in args.min_guess_probability:
                methods[f"medusa{tag}-p{p:g}"] = SpeculativeConfig("medusa", num_tokens=k, min_guess_probability=p)
                medusa_rows[f"medusa{tag}-p{p:g}"] = None
    engines = {name: load_engine(args.engine, RuntimeConfig(num_threads=args.threads, speculative=spec,
                                                            enable_prefix_caching=False))
               for name, spec in methods.items()}
    for name, rows in medusa_rows.items():
        speculator = engines[name].speculator
        # Medusa heads only: hydra heads' states cost nothing per row
        if speculator is not None and isinstance(speculator.proposer, MedusaProposer):
            spec = methods[name]
            assert spec is not None
            speculator.proposer = MedusaProposer(engines[name].runner.num_medusa_heads, rows,
                                                 spec.guess_probability(hydra=False))
    ids = prompts(engines["plain"], TASKS if args.workload == "grounded" else open_questions())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results: dict[str, dict[str, Any]] = {name: {"single": [], "aggregate": []} for name in methods}
    outputs: dict[str, list[list[int]]] = {}
    for name, engine in engines.items():  # warm-up, and the outputs every method must reproduce
        outputs[name] = [o.outputs[0].token_ids for o in _generate(engine, ids, params)]
    for name in methods:
        if outputs[name] != outputs["plain"]:
            print(f"warning: {name} greedy output differs from plain decoding")
    for r in range(args.rounds):
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]  # no method always first
        for name, engine in order:
            before = _spec_counts(engine)
            tokens, seconds = single_stream(engine, ids, params, now)
            results[name]["single"].append({"tok_s": tokens / seconds, **spec_summary(engine, before)})
            if not args.skip_aggregate:
                before = _spec_counts(engine)
                tokens, seconds = aggregate(engine, ids, params, args.concurrency, now)
                results[name]["aggregate"].append({"tok_s": tokens / seconds, **spec_summary(engine, before)})
            line = f"round {r}: {name:15s} single {results[name]['single'][-1]['tok_s']:.1f} tok/s"
            if not args.skip_aggregate:
                line += f", {args.concurrency}-way {results[name]['aggregate'][-1]['tok_s']:.1f} tok/s"
            print(line, flush=True)
    report = {"engine": str(args.engine), "workload": args.workload, "clock": args.clock, "threads": args.threads,
              "num_tokens": args.num_tokens, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
              "results": results}
    print()
    for kind in ("single", "aggregate"):
        if not results["plain"][kind]:
            continue
        base = [x["tok_s"] for x in results["plain"][kind]]
        for name in methods:
            runs = results[name][kind]
            ratios = [x["tok_s"] / b for x, b in zip(runs, base, strict=True)]
            line = (f"{kind:9s} {name:15s} {statistics.median(x['tok_s'] for x in runs):7.1f} tok/s  "
                    f"x{statistics.median(ratios):.2f} vs plain (rounds {min(ratios):.2f}-{max(ratios):.2f})")
            if name != "plain":
                line += (f"  acceptance {statistics.median(x['acceptance_rate'] for x in runs):.2f}, "
                         f"{statistics.median(x['tokens_per_verification'] for x in runs):.2f} tokens/verification")
            print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def _spec_counts(engine: Engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s.num_spec_verifications, s.num_spec_proposed_tokens, s.num_spec_accepted_tokens


def _generate(engine: Engine, ids: list[list[int]], params: SamplingParams) -> list[Any]:
    from kiln.runtime.llm import LLM

    return LLM(engine).generate(ids, params)


if __name__ == "__main__":
    main()
