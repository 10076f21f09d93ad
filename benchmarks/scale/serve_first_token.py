"""Time `kiln serve ENGINE` from process start to its first streamed token, and its resident memory after load.

    nice .venv/bin/python benchmarks/scale/serve_first_token.py ENGINE [--kv-cache-bytes N] [--max-tokens 8]
        [--results benchmarks/scale/results.jsonl] [--cold]

Reads the engine's files once first, so they are in the page cache (what a restart of a server finds), unless
--cold. Then starts `kiln serve ENGINE` on a free port, polls /health until it answers (the server binds its port
only once the engine has loaded: time to ready), reads the server's resident memory from /proc/PID/status
(VmRSS, split into anonymous and file-backed pages) and its CPU time, sends one streamed /v1/completions request and
times the first streamed token from the process's start. The KV pool's size is the one the server logs at start-up. The
bound checked is issue-level: resident memory after load <= engine size + 1 GiB + the KV pool. One JSON line is
appended to --results.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

KILN = Path(sys.executable).with_name("kiln")
GIB = 2**30
KV_POOL_LINE = re.compile(r"KV pool: .*?, ([0-9.]+) MiB;")


def engine_bytes(engine: Path) -> int:
    return sum(f.stat().st_size for f in engine.rglob("*") if f.is_file())


def read_through(engine: Path) -> float:
    """Read every file of the engine once (into the page cache); seconds taken."""
    start = time.perf_counter()
    for path in engine.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(1 << 24):
                    pass
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memory_gib(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM of pid, in GiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 2**20, 3)  # kB -> GiB
    return fields


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of pid so far: on a shared host, what the wall time would be were the cores free
    (for the single-threaded parts of a load; the packing of weights runs on every core)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def wait_ready(server: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"kiln serve did not answer /health within {timeout:.0f} s; see {log}")


def first_token(port: int, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(perf_counter at the first streamed token, at the stream's end, chunks carrying text) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"/v1/completions answered {response.status}: {response.read()[:500]!r}")
    first, chunks = None, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if event.get("choices"):
            chunks += 1
            first = first or time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first, time.perf_counter(), chunks


def measure(engine: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    log = args.log or engine.with_name(engine.name + "-serve.log")
    cmd = [str(KILN), "serve", str(engine), "--port", str(port), "--no-web-ui"]
    if args.kv_cache_bytes:
        cmd += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    with log.open("w") as out:
        start = time.perf_counter()
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(server, port, log, args.timeout)
        ready = time.perf_counter()
        ready_cpu, loaded = cpu_seconds(server.pid), memory_gib(server.pid)
        token_at, done_at, chunks = first_token(port, args.prompt, args.max_tokens)
        after = memory_gib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    pool = KV_POOL_LINE.search(log.read_text())
    return {"time_to_ready_s": round(ready - start, 2), "time_to_first_token_s": round(token_at - start, 2),
            "request_first_token_s": round(token_at - ready, 2), "request_total_s": round(done_at - ready, 2),
            "cpu_s_to_ready": round(ready_cpu, 2), "streamed_chunks": chunks, "load_rss_gib": loaded.get("VmRSS"),
            "load_rss_anon_gib": loaded.get("RssAnon"),
            "load_rss_file_gib": loaded.get("RssFile"), "rss_after_request_gib": after.get("VmRSS"),
            "peak_rss_gib": after.get("VmHWM"), "kv_pool_gib": round(float(pool.group(1)) / 1024, 3) if pool else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", type=Path)
    parser.add_argument("--kv-cache-bytes", type=int, help="passed to kiln serve (default: the server's own)")
    parser.add_argument("--prompt", default="Hello")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--cold", action="store_true", help="do not read the engine into the page cache first")
    parser.add_argument("--log", type=Path, help="the server's output (default: ENGINE-serve.log beside ENGINE)")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("results.jsonl"))
    args = parser.parse_args()
    if not (args.engine / "manifest.json").is_file():
        parser.error(f"{args.engine} is not a kiln engine directory (no manifest.json)")
    size = engine_bytes(args.engine)
    warm_s = None if args.cold else round(read_through(args.engine), 1)
    result = {"benchmark": "serve_first_token", "engine": args.engine.name, "engine_gib": round(size / GIB, 3),
              "page_cache_warmed": not args.cold, "read_through_s": warm_s}
    result.update(measure(args.engine, args))
    from run import cpu_model  # after the measurement: run.py's imports (torch) stay out of the timed window

    kv = result["kv_pool_gib"] or 0.0
    result.update({"rss_bound_gib": round(size / GIB + 1 + kv, 3), "cpu": cpu_model(),
                   "date": time.strftime("%Y-%m-%d"), "host_load": round(os.getloadavg()[0], 2)})
    result["within_rss_bound"] = result["load_rss_gib"] <= result["rss_bound_gib"]
    with args.results.open("a") as out:
        out.write(json.dumps(result) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
