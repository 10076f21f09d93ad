"""The serving load against llama-server and `kiln serve`: the same streaming /v1/completions client
(kiln bench --server's), the same seeded random token-id prompts, greedy, ignore_eos."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kiln.runtime.bench.offline import BenchConfig, synthetic_prompts
from kiln.runtime.bench.serving import run_server_workload


@dataclass(frozen=True)
class ServingLoad:
    num_requests: int = 64
    input_len: int = 200
    output_len: int = 128
    concurrency: int = 16

    def __post_init__(self) -> None:
        if min(self.num_requests, self.input_len, self.output_len, self.concurrency) < 1:
            raise ValueError(f"every field of ServingLoad must be >= 1, got {self}")

    def bench_config(self) -> BenchConfig:
        return BenchConfig(num_requests=self.num_requests, input_len=self.input_len, output_len=self.output_len,
                           concurrency=self.concurrency, seed=200)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy; log {log}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # not listening yet, or 503 while loading
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not healthy within {timeout_s:.0f} s; log {log}")


@contextmanager
def running_server(cmd: list[str], port: int, log: Path):
    """Start a server (output to log), yield its URL once /health answers, stop it afterwards."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kiln_serve_cmd(kiln: Path, engine_dir: Path, port: int) -> list[str]:
    return [str(kiln), "serve", str(engine_dir), "--host", "127.0.0.1", "--port", str(port)]


def measure_server(url: str, load: ServingLoad, vocab_size: int) -> dict[str, float]:
    """A short warm-up, then the load; figures keyed as report.Figure keys."""
    cfg = load.bench_config()
    warm = BenchConfig(num_requests=2, input_len=16, output_len=4, seed=1)

    async def both() -> dict:
        await run_server_workload(url, warm, synthetic_prompts(warm, vocab_size))
        return await run_server_workload(url, cfg, synthetic_prompts(cfg, vocab_size))

    run = asyncio.run(both())
    if run["num_errors"] == load.num_requests:
        raise RuntimeError(f"all {load.num_requests} requests failed: {run['first_error']}")
    if run["num_errors"]:  # recorded (a column of the table), not fatal: the other figures count served requests
        print(f"[peers] {run['num_errors']} of {load.num_requests} requests failed: {run['first_error']}", flush=True)
    return {"serve_output_tok_s": run["output_tok_per_s"], "serve_ttft_p50_s": run["ttft_ms"]["p50"] / 1000,
            "serve_ttft_p90_s": run["ttft_ms"]["p90"] / 1000, "serve_tpot_p50_ms": run["tpot_ms"]["p50"],
            "serve_failed": float(run["num_errors"])}
