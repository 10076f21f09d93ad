"""`kiln bench ENGINE_DIR --server URL`: the offline benchmark's workload and figures, measured
against a running `kiln serve` over streaming HTTP (httpx + asyncio, bounded concurrency).

The workload is the offline bench's (kiln.runtime.bench.offline): the same seeded random token-id
prompts (the engine dir gives the vocabulary), greedy, ``ignore_eos`` so every request
yields exactly output_len tokens, all at t=0 or Poisson arrivals, at most ``concurrency``
in flight. TTFT runs from sending the request to its first content chunk; ITL is the gap
between successive content chunks (the server sends one per engine step of that request).
KV peak is sampled from /metrics during the run.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.runtime.bench.offline import BenchConfig, percentiles, say
from kiln.runtime.bench.offline import synthetic_prompts as bench_prompts  # the very same prompts as the offline run

if TYPE_CHECKING:
    import httpx  # imported where used: only `bench --server` needs it


@dataclass
class _Trace:
    ttft: float | None = None
    latency: float | None = None  # sending the request to its last chunk
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> _Trace:
    trace, start = _Trace(), time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return trace
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    trace.error = chunk["error"]["message"]
                    return trace
                if chunk.get("usage"):
                    trace.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if trace.ttft is None:
                        trace.ttft = now - start
                    else:
                        trace.gaps.append(now - last)
                    last = now
        trace.latency = last - start
    except Exception as e:  # a failed request counts as failed; the run goes on
        trace.error = f"{type(e).__name__}: {e}"
    return trace


async def _kv_sampler(client: httpx.AsyncClient, url: str, peak: list[float]) -> None:
    while True:
        try:
            text = (await client.get(url + "/metrics")).text
            used = re.search(r"^kiln_kv_cache_blocks_used (\S+)$", text, re.M)
            total = re.search(r"^kiln_kv_cache_blocks_total (\S+)$", text, re.M)
            if used and total:
                peak[0], peak[1] = max(peak[0], float(used.group(1))), float(total.group(1))
        except Exception:  # metrics are a nicety; never fail the run for them
            pass
        await asyncio.sleep(0.25)


async def run_server_workload(url: str, cfg: BenchConfig, prompts: list[list[int]],
                              api_key: str | None = None) -> dict[str, Any]:
    """Drive the server over the workload (as Bearer api_key, when given); returns the offline bench's measurements."""
    import httpx

    limit = cfg.concurrency or cfg.num_requests
    rng = np.random.default_rng(cfg.seed + 1)
    gaps = rng.exponential(1.0 / cfg.request_rate, cfg.num_requests) if cfg.request_rate else np.zeros(cfg.num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    limits = httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits, headers=headers) as client:
        gate = asyncio.Semaphore(limit)
        peak = [0.0, 0.0]
        t0 = time.perf_counter()

        async def request(i: int) -> _Trace:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
            async with gate:
                return await _one(client, url, {
                    "prompt": prompts[i], "max_tokens": cfg.output_len, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}})

        sampler = asyncio.create_task(_kv_sampler(client, url, peak))
        traces = await asyncio.gather(*(request(i) for i in range(cfg.num_requests)))
        elapsed = time.perf_counter() - t0
        sampler.cancel()
    ok = [t for t in traces if t.error is None]
    errors = [t.error for t in traces if t.error is not None]
    if not ok:
        raise RuntimeError(f"every request failed; first error: {errors[0]}")
    total_out = sum(t.output_tokens for t in ok)
    return {
        "config": asdict(cfg),
        "elapsed_s": round(elapsed, 4),
        "num_errors": len(errors),
        "first_error": errors[0] if errors else None,
        "requests_per_s": round(len(ok) / elapsed, 3),
        "output_tok_per_s": round(total_out / elapsed, 2),
        "total_tok_per_s": round((total_out + len(ok) * cfg.input_len) / elapsed, 2),
        "ttft_ms": percentiles([t.ttft for t in ok if t.ttft is not None]),
        "itl_ms": percentiles([g for t in ok for g in t.gaps]),
        # Per output token after the first; unlike ITL it holds when a server packs several tokens in one chunk.
        "tpot_ms": percentiles([(t.latency - t.ttft) / (t.output_tokens - 1) for t in ok
                                if t.ttft is not None and t.latency is not None and t.output_tokens > 1]),
        "kv_blocks_total": int(peak[1]),
        "kv_blocks_peak": int(peak[0]),
        "kv_peak_fraction": round(peak[0] / peak[1], 4) if peak[1] else None,
    }


def bench_server(url: str, engine_dir: str, cfg: BenchConfig, concurrencies: tuple[int | None, ...] = (None,),
                 json_path: str | None = None, api_key: str | None = None) -> dict[str, Any]:
    """`kiln bench --server`: one run of the workload per concurrency; prints and returns the report."""
    from kiln.manifest import read_manifest

    url = url.rstrip("/").removesuffix("/v1")
    vocab = read_manifest(Path(engine_dir), verify_checksums=False).spec.vocab_size

    async def main() -> list[dict[str, Any]]:
        warm = replace(cfg, num_requests=2, input_len=16, output_len=4, concurrency=None, request_rate=None)
        await run_server_workload(url, warm, bench_prompts(warm, vocab), api_key)
        runs = []
        for conc in concurrencies:
            run_cfg = replace(cfg, concurrency=conc)
            say(f"server {url}: {run_cfg.num_requests} requests x ({run_cfg.input_len} in, {run_cfg.output_len} "
                f"out), concurrency {conc or 'all'}, rate {run_cfg.request_rate or 'inf'}")
            result = await run_server_workload(url, run_cfg, bench_prompts(run_cfg, vocab), api_key)
            say(f"  {result['requests_per_s']} req/s, {result['output_tok_per_s']} output tok/s, "
                f"TTFT p50/p90/p99 {'/'.join(str(v) for v in result['ttft_ms'].values())} ms, "
                f"ITL p50/p90/p99 {'/'.join(str(v) for v in result['itl_ms'].values())} ms, "
                f"{result['num_errors']} errors")
            runs.append(result)
        return runs

    report = {"engine": str(engine_dir), "server": url, "runs": asyncio.run(main())}
    text = json.dumps(report, indent=2)
    if json_path:
        Path(json_path).write_text(text)
    print(text)
    return report
