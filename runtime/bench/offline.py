"""kiln bench: offline throughput and latency over a synthetic workload, plus the memory-bandwidth floor.

Requests of input_len random tokens each generate exactly output_len tokens (ignore_eos).
They arrive all at once or as a Poisson process (request_rate), and at most `concurrency`
are in flight. Reported: requests/s, output tok/s, TTFT and inter-token latency percentiles,
peak KV pool use; and separately single-stream decode tok/s next to the bound set by memory
bandwidth / weight bytes per token (every decoded token streams all weights once).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import require
from kiln.manifest import read_manifest
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.ops import library_variant
from kiln.runtime.ort_runner import OrtModelRunner
from kiln.runtime.outputs import EngineStats
from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.runtime.pipeline.runner import PipelineRunner


@dataclass(frozen=True)
class BenchConfig:
    num_requests: int = 32
    input_len: int = 128
    output_len: int = 64
    concurrency: int | None = None  # max requests in flight (None: all)
    request_rate: float | None = None  # Poisson arrivals per second (None: all at t=0)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len"):
            require(getattr(self, name) >= 1, name, ">= 1", getattr(self, name))
        require(self.concurrency is None or self.concurrency >= 1, "concurrency", ">= 1 (omit it for all at once)",
                self.concurrency)
        require(self.request_rate is None or self.request_rate > 0, "request_rate",
                "> 0 (omit it for all at t=0)", self.request_rate)


def say(message: str) -> None:
    """A progress line on stderr (stdout carries the JSON report)."""
    print(f"[kiln bench] {message}", file=sys.stderr, flush=True)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p = np.percentile(np.asarray(values) * 1000.0, [50, 90, 99])
    return {"p50": round(float(p[0]), 2), "p90": round(float(p[1]), 2), "p99": round(float(p[2]), 2)}


def memory_bandwidth_gbps(size_mb: int = 256, repeats: int = 5) -> dict[str, float]:
    """Best-of-n read bandwidth (numpy max, one slice per core, as the model's threads read
    weights) and single-thread copy bandwidth (read + write), GB/s."""
    a = np.ones(size_mb * (1 << 20) // 4, dtype=np.float32)
    b = np.empty_like(a)
    workers = os.cpu_count() or 1
    parts = np.array_split(a, workers)
    read, copy = [], []
    with ThreadPoolExecutor(workers) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            list(pool.map(np.max, parts))  # reductions release the GIL
            read.append(a.nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            np.copyto(b, a)
            copy.append(2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return {"read_gbps": round(max(read), 2), "copy_gbps": round(max(copy), 2)}


def engine_file_bytes(engine_dir: Path) -> int:
    """The bytes of the engine's graphs and their weights (model.onnx*, or every stage's): the bandwidth floor's
    denominator where the graphs cannot be read (kiln.optimize.weight_bytes counts what a step reads)."""
    graphs = read_manifest(engine_dir, verify_checksums=False).graph_files
    return sum(p.stat().st_size for graph in graphs for p in Path(engine_dir).glob(f"{graph}*"))


def synthetic_prompts(cfg: BenchConfig, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(cfg.seed)
    return [rng.integers(100, vocab - 100, size=cfg.input_len).tolist() for _ in range(cfg.num_requests)]


def run_workload(
    engine: Engine, cfg: BenchConfig, progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Drive the engine over the workload; returns the measurements as a dict."""
    prompts = synthetic_prompts(cfg, engine.runner.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=cfg.output_len, ignore_eos=True)
    rng = np.random.default_rng(cfg.seed + 1)
    gaps = rng.exponential(1.0 / cfg.request_rate, cfg.num_requests) if cfg.request_rate else np.zeros(cfg.num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    limit = cfg.concurrency or cfg.num_requests
    first: dict[str, float] = {}  # request -> TTFT
    last: dict[str, float] = {}  # request -> time of its latest output
    itl: list[float] = []
    done = 0
    start_of: dict[str, float] = {}
    next_req, peak_blocks, steps = 0, 0, 0
    t0 = time.perf_counter()
    last_report = t0
    stats0 = engine.stats()
    preempt0 = stats0.num_preemptions
    while done < cfg.num_requests:
        now = time.perf_counter() - t0
        while next_req < cfg.num_requests and arrivals[next_req] <= now and len(start_of) - done < limit:
            rid = f"bench-{next_req}"
            engine.add_request(rid, prompts[next_req], params)
            start_of[rid] = time.perf_counter()  # TTFT counts from submission (after the client's wait)
            next_req += 1
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, arrivals[next_req] - now)))
            continue
        outputs = engine.step()
        steps += 1
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
        t = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            if rid not in first:
                first[rid] = t - start_of[rid]
            elif rid in last:
                itl.append(t - last[rid])
            last[rid] = t
            if out.finished:
                done += 1
        if progress and t - last_report > 1.0:
            last_report = t
            progress(f"{done}/{cfg.num_requests} requests done, {engine.num_generated_tokens} tokens, "
                     f"{t - t0:.1f}s")
    elapsed = time.perf_counter() - t0
    total_out = cfg.num_requests * cfg.output_len
    return {
        "config": asdict(cfg),
        "elapsed_s": round(elapsed, 4),
        "steps": steps,
        "requests_per_s": round(cfg.num_requests / elapsed, 3),
        "output_tok_per_s": round(total_out / elapsed, 2),
        "total_tok_per_s": round((total_out + cfg.num_requests * cfg.input_len) / elapsed, 2),
        "ttft_ms": percentiles(list(first.values())),
        "itl_ms": percentiles(itl),
        "kv_blocks_total": engine.block_manager.num_blocks,
        "kv_blocks_peak": peak_blocks,
        "kv_peak_fraction": round(peak_blocks / engine.block_manager.num_blocks, 4),
        "num_preemptions": engine.stats().num_preemptions - preempt0,
        "speculative": speculation_summary(engine, stats0),
        "pipeline": pipeline_summary(engine, stats0),
        "tensor_parallel": tensor_parallel_summary(engine, stats0),
    }


def pipeline_summary(engine: Engine, before: EngineStats) -> dict[str, Any] | None:
    """Each stage's share of the time its stages computed since `before`, and the hidden-state bytes handed
    between stages per token (None for a one-graph engine)."""
    now, then = engine.stats().pipeline, before.pipeline
    if not now.stage_seconds:
        return None
    seconds = [a - b for a, b in zip(now.stage_seconds, then.stage_seconds or [0.0] * len(now.stage_seconds),
                                     strict=True)]
    tokens = now.tokens - then.tokens
    return {"stage_seconds": [round(s, 4) for s in seconds],
            "stage_share": [round(s / sum(seconds), 4) for s in seconds] if sum(seconds) else None,
            "bytes_moved": now.bytes_moved - then.bytes_moved, "tokens": tokens,
            "bytes_per_token": round((now.bytes_moved - then.bytes_moved) / tokens, 1) if tokens else None}


def tensor_parallel_summary(engine: Engine, before: EngineStats) -> dict[str, Any] | None:
    """Each rank's seconds since `before`, the part of them it waited in kiln.AllReduce for the others, and the
    bytes the ranks reduced (None for an engine without tensor-parallel ranks)."""
    now, then = engine.stats().tensor_parallel, before.tensor_parallel
    if not now.rank_seconds:
        return None

    def since(a: tuple[float, ...], b: tuple[float, ...]) -> list[float]:
        return [round(x - (b[i] if i < len(b) else 0.0), 4) for i, x in enumerate(a)]

    seconds, waits = since(now.rank_seconds, then.rank_seconds), since(now.wait_seconds, then.wait_seconds)
    return {"rank_seconds": seconds, "all_reduce_wait_seconds": waits,
            "wait_share": [round(w / s, 4) if s else None for w, s in zip(waits, seconds, strict=True)],
            "all_reduce_bytes": now.all_reduce_bytes - then.all_reduce_bytes, "steps": now.steps - then.steps}


def single_stream(engine: Engine, input_len: int = 16, output_len: int = 64) -> dict[str, float]:
    """Decode speed of one sequence: (output_len - 1) tokens over the time after the first one."""
    prompt = synthetic_prompts(BenchConfig(num_requests=1, input_len=input_len), engine.runner.vocab_size)[0]
    engine.add_request("single", prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    times = []
    tokens = 0  # a speculative step may add several
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        if outputs:
            times.append(time.perf_counter())
            tokens += len(outputs[0].outputs[0].token_ids)
    return {
        "prefill_tok_per_s": round(input_len / (times[0] - t0), 2),
        "decode_tok_per_s": round((tokens - 1) / (times[-1] - times[0]), 2),
    }


def speculation_summary(engine: Engine, before: EngineStats) -> dict[str, Any] | None:
    """Acceptance since `before` (None without speculation)."""
    if engine.proposer is None:
        return None
    s = engine.stats()
    verifications = s.num_spec_verifications - before.num_spec_verifications
    proposed = s.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = s.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    return {
        "verifications": verifications,
        "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "tokens_per_verification": round(1 + accepted / verifications, 3) if verifications else None,
    }


def prefill_throughput(engine: Engine, input_len: int = 512) -> float:
    prompt = synthetic_prompts(BenchConfig(num_requests=1, input_len=input_len, seed=7), engine.runner.vocab_size)[0]
    engine.add_request("prefill", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return round(input_len / (time.perf_counter() - t0), 2)


def bench(engine_dir: str, cfg: BenchConfig, concurrencies: tuple[int | None, ...] = (None,),
          config: RuntimeConfig | None = None, json_path: str | None = None,
          weight_bytes_per_token: int | None = None) -> dict[str, Any]:
    """weight_bytes_per_token: what a decode step reads (the caller counts it from the graphs where it can); None
    counts the engine's files."""
    engine = load_engine(engine_dir, config or RuntimeConfig(enable_prefix_caching=False))
    # which copy of the CPU kernels ran (AVX2 or AVX-512 VNNI): figures of the two are not comparable
    kernels = library_variant() if isinstance(engine.runner, OrtModelRunner | PipelineRunner) else None
    say(f"engine {engine.model_name}: {engine.block_manager.num_blocks} KV blocks of "
        f"{engine.runner.block_size} tokens, max_num_tokens {engine.scheduler.max_num_tokens}"
        + (f", kernels {kernels}" if kernels else ""))
    run_workload(engine, BenchConfig(num_requests=2, input_len=16, output_len=4))  # warm-up
    bandwidth = memory_bandwidth_gbps()
    wbytes, counted_from = ((weight_bytes_per_token, "graph") if weight_bytes_per_token is not None
                            else (engine_file_bytes(Path(engine_dir)), "files"))
    single = single_stream(engine)
    single["prefill_512_tok_per_s"] = prefill_throughput(engine)
    floor = bandwidth["read_gbps"] * 1e9 / wbytes
    say(f"single stream: decode {single['decode_tok_per_s']} tok/s (bandwidth bound {floor:.1f} tok/s: "
        f"{bandwidth['read_gbps']} GB/s / {wbytes / 1e6:.1f} MB of weights read a token), "
        f"prefill {single['prefill_512_tok_per_s']} tok/s")
    runs = []
    for conc in concurrencies:
        run_cfg = BenchConfig(**{**asdict(cfg), "concurrency": conc})
        say(f"workload: {run_cfg.num_requests} requests x ({run_cfg.input_len} in, {run_cfg.output_len} out), "
            f"concurrency {conc or 'all'}, rate {run_cfg.request_rate or 'inf'}")
        result = run_workload(engine, run_cfg, say)
        say(f"  {result['requests_per_s']} req/s, {result['output_tok_per_s']} output tok/s, "
            f"TTFT p50 {result['ttft_ms']['p50']} ms, ITL p50 {result['itl_ms']['p50']} ms, "
            f"KV peak {result['kv_blocks_peak']}/{result['kv_blocks_total']} blocks")
        if (stages := result["pipeline"]) is not None:
            say(f"  pipeline: stage seconds {stages['stage_seconds']}, {stages['bytes_per_token']} bytes per token "
                "handed between stages")
        if (ranks := result["tensor_parallel"]) is not None:
            say(f"  tensor parallel: rank seconds {ranks['rank_seconds']}, of which waiting in the all-reduce "
                f"{ranks['all_reduce_wait_seconds']}, {ranks['all_reduce_bytes']} bytes reduced")
        if (spec := result["speculative"]) is not None:
            say(f"  speculative: acceptance rate {spec['acceptance_rate']}, {spec['tokens_per_verification']} "
                f"tokens per verification ({spec['verifications']} verifications)")
        runs.append(result)
    report = {
        "engine": str(engine_dir),
        "op_library": kernels,
        "memory_bandwidth": bandwidth,
        "weight_bytes_per_token": wbytes,
        "weight_bytes_counted_from": counted_from,  # "graph", or "files" where onnx is not installed
        "bandwidth_bound_decode_tok_per_s": round(floor, 2),
        "single_stream": single,
        "runs": runs,
    }
    text = json.dumps(report, indent=2)
    if json_path:
        Path(json_path).write_text(text)
    print(text)
    engine.runner.close()
    return report
