"""`kiln serve --replicas` layouts against each other on one machine, in interleaved rounds.

Layouts (each deployed on one local Ray session, in turn, every round):
- `1x2`: one replica with 2 threads (what `kiln serve --num-threads 2` gives, behind the cluster ingress)
- `2x1-prefix`, `2x1-rr`: two replicas with 1 thread each, prefix-affinity or round-robin routing
- `p1d1`: disaggregated, one prefill and one decode replica, 1 thread each

Workloads:
- `shared`: S system prompts x Q questions (chat-formatted, the system prompt ~150 tokens), random order,
  C requests in flight, greedy, max_tokens each. Reports output tok/s (wall), output tokens per CPU second
  of the replicas (steadier on a shared machine), TTFT p50/p90 and the prefix-cache hit rate as a share of
  the ideal (every system prompt computed once).
- `mixed`: long prompts (~500 tokens, max_tokens 8) arriving while short-prompt requests decode (max_tokens
  64): the decoders' inter-token latency p50/p90 and the long prompts' TTFT, where disaggregation moves
  prompts off the decoding replica.

    python benchmarks/bench_cluster.py ENGINE_DIR [--rounds 2] [--layouts 1x2,2x1-prefix,2x1-rr,p1d1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime.cluster.launch import ClusterOptions, connect_ray, deploy, undeploy
from kiln.runtime.params import RuntimeConfig, SamplingParams

LAYOUTS = {
    "1x2": (ClusterOptions(replicas=1), 2),
    "2x1-prefix": (ClusterOptions(replicas=2, routing="prefix"), 1),
    "2x1-rr": (ClusterOptions(replicas=2, routing="round-robin"), 1),
    "p1d1": (ClusterOptions(replicas=1, prefill_replicas=1), 1),
}
TOPICS = ["a bakery", "a bicycle shop", "a public library", "a hotel front desk", "a train station",
          "a garden centre", "a museum", "a dentist's office"]


@dataclass
class Run:
    output_tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    hits: int = 0
    ideal: int = 0


def system_prompt(topic: str) -> str:
    rules = " ".join(f"Rule {i}: answer politely, briefly and only about {topic}, and never invent prices, "
                     f"opening hours or names that were not given." for i in range(1, 6))
    return f"You are the assistant of {topic}. {rules} Keep every answer under three sentences."


async def timed(llm: Any, prompt: list[int], params: SamplingParams, request_id: str, run: Run, itl: bool) -> None:
    start = last = time.perf_counter()
    first = True
    async for out in llm.generate(prompt, params, request_id):
        now, n = time.perf_counter(), sum(len(o.token_ids) for o in out.outputs)
        if n and first:
            run.ttft.append(now - start)
            first = False
        elif n and itl:
            run.itl.extend([(now - last) / n] * n)
        if n:
            last = now
        run.output_tokens += n


async def shared(llm: Any, tag: str, systems: int, questions: int, concurrency: int, max_tokens: int) -> Run:
    tok = llm.tokenizer
    prompts = {(s, q): tok.encode(llm.apply_chat_template([
        {"role": "system", "content": system_prompt(TOPICS[s % len(TOPICS)])},
        {"role": "user", "content": f"Question {q}: what should I know before my visit number {q}?"}]))
        for s in range(systems) for q in range(questions)}
    order = list(prompts)
    random.Random(0).shuffle(order)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    block = llm.info.block_size
    common = [min(len(_common(prompts[s, 0], prompts[s, 1])), len(prompts[s, 0]) - 1) // block * block
              for s in range(systems)]
    gate = asyncio.Semaphore(concurrency)
    run = Run(ideal=sum(common) * (questions - 1))

    async def one(s: int, q: int) -> None:
        async with gate:
            await timed(llm, prompts[s, q], params, f"{tag}-{s}-{q}", run, itl=False)

    await measured(llm, run, asyncio.gather(*(one(s, q) for s, q in order)))
    return run


async def mixed(llm: Any, tag: str, decoders: int, long_prompts: int) -> Run:
    tok = llm.tokenizer
    long_text = " ".join(system_prompt(t) for t in TOPICS)
    decode_params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    run, long_run = Run(), Run()

    async def long_one(i: int) -> None:
        await asyncio.sleep(0.5 + 0.7 * i)  # while the decoders decode
        prompt = tok.encode(f"Document {i}. {long_text} Summarise document {i}.")[:500]
        await timed(llm, prompt, long_params, f"{tag}-long-{i}", long_run, itl=False)

    decode = [timed(llm, tok.encode(f"Count slowly from {i} upwards:"), decode_params, f"{tag}-dec-{i}", run, True)
              for i in range(decoders)]
    await measured(llm, run, asyncio.gather(*decode, *(long_one(i) for i in range(long_prompts))))
    run.ttft = long_run.ttft  # the long prompts' time to first token
    return run


async def measured(llm: Any, run: Run, work: Any) -> None:
    before = await replica_totals(llm)
    start = time.perf_counter()
    await work
    run.wall_s = time.perf_counter() - start
    after = await replica_totals(llm)
    run.cpu_s, run.hits = after[0] - before[0], after[1] - before[1]


async def replica_totals(llm: Any) -> tuple[float, int]:
    stats = await llm.replica_stats("engine") + await llm.replica_stats("prefill")
    return sum(s.cpu_s for s in stats), sum(s.stats.prefix_cache_hits for s in stats)


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else float("nan"))


def summary(run: Run) -> dict[str, float]:
    return {"tok_s": run.output_tokens / run.wall_s, "tok_per_cpu_s": run.output_tokens / max(run.cpu_s, 1e-9),
            "ttft_p50_ms": 1e3 * pct(run.ttft, 50), "ttft_p90_ms": 1e3 * pct(run.ttft, 90),
            "itl_p50_ms": 1e3 * pct(run.itl, 50), "itl_p90_ms": 1e3 * pct(run.itl, 90),
            "hit_rate_of_ideal": run.hits / run.ideal if run.ideal else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default="1x2,2x1-prefix,2x1-rr,p1d1")
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-bytes", type=int, default=48 << 20)
    parser.add_argument("--workloads", default="shared,mixed")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    workloads = args.workloads.split(",")
    connect_ray(ClusterOptions(replicas=2), RuntimeConfig(num_threads=1))
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for r in range(args.rounds):
        for name in layouts:
            options, threads = LAYOUTS[name]
            config = RuntimeConfig(num_threads=threads, kv_cache_bytes=args.kv_cache_bytes, max_model_len=1024,
                                   max_num_seqs=16)
            llm = deploy(args.engine_dir, config, options, app=f"bench-{name}")
            try:
                for workload in workloads:
                    tag = f"{name}-{workload}-{r}"
                    if workload == "shared":
                        run = asyncio.run(shared(llm, tag, args.systems, args.questions, args.concurrency,
                                                 args.max_tokens))
                    else:
                        run = asyncio.run(mixed(llm, tag, decoders=6, long_prompts=4))
                    figures = summary(run)
                    results.setdefault(workload, {}).setdefault(name, []).append(figures)
                    print(f"round {r} {workload:6s} {name:11s} " + " ".join(f"{k}={v:.3g}" for k, v in figures.items()),
                          flush=True)
            finally:
                undeploy(f"bench-{name}")
    print("\nmedians over rounds")
    for workload, by_layout in results.items():
        for name, runs in by_layout.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"{workload:6s} {name:11s} " + " ".join(f"{k}={v:.3g}" for k, v in med.items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
