"""The trickle's p99 latency alone and under parts of tests/engine/test_server_hostile.py's hostile mix, per server
configuration, in interleaved rounds: which hostile clients cost the trickle, and whether a setting helps.

    python benchmarks/bench_hostile_parts.py ENGINE_DIR --group all --rounds 3 \
        --config default='{}' --config sw1ms='{"env": {"PYTHONPATH": "DIR", "PROBE": "..."}}'

A configuration is a JSON object with "env" (added to the server's environment) and "args" (added to
`kiln serve`'s options, after the hostile test's own). Groups: each generating client alone (burst, aborts,
readers), those together (gen), the HTTP-level ones together (http: large bodies, slowloris, bad text, long
prompts), and all of them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "engine")]

import test_server_hostile as hostile  # noqa: E402
from server_process import Server  # noqa: E402

GENERATING = ("aborts", "readers", "burst")
HTTP = ("large", "slowloris", "text", "long")
GROUPS = {"burst": ("burst",), "aborts": ("aborts",), "readers": ("readers",), "gen": GENERATING, "http": HTTP,
          "all": GENERATING + HTTP}
CLIENTS = {"large": hostile.large_bodies, "slowloris": hostile.slowloris, "aborts": hostile.abort_flood,
           "text": hostile.bad_text, "long": hostile.long_prompts}
SERVE = ("--max-model-len", "256", "--max-queue", "8", "--max-num-seqs", "16", "--num-threads", "1",
         "--max-connections", "96", "--read-timeout", "2")


def mix(endpoint: Any, names: tuple[str, ...], go: Any, done: Any) -> None:
    """The group's clients at once, in a process of their own (their Python work never the timer's)."""
    go.wait(60)
    threads = [threading.Thread(target=CLIENTS[n], args=(endpoint,), daemon=True) for n in names if n in CLIENTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    done.put(True)


def one_round(server: Server, names: tuple[str, ...]) -> tuple[float, float, int]:
    """(p99 alone, p99 under the group, trickle requests under it)."""
    baseline = hostile.Trickle(server.url, count=hostile.BASELINE_REQUESTS)
    baseline.run()
    endpoint = hostile.Endpoint(server.url, server.port)
    readers = hostile.slow_readers(endpoint) if "readers" in names else []
    context = multiprocessing.get_context("spawn")
    done, go = context.Queue(), context.Event()
    process = context.Process(target=mix, args=(endpoint, names, go, done), daemon=True)
    process.start()
    time.sleep(3)
    trickle = hostile.Trickle(server.url)
    trickle.start()
    time.sleep(0.5)
    go.set()
    time.sleep(1.5)
    if "burst" in names:
        hostile.queue_burst(endpoint, trickle)
    done.get(timeout=90)
    process.join(10)
    time.sleep(0.5)
    trickle.stop.set()
    trickle.join(30)
    for sock in readers:
        sock.close()
    return hostile.p99(baseline.latencies), hostile.p99(trickle.latencies), len(trickle.latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--group", choices=sorted(GROUPS), default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", action="append", default=[], help="NAME=JSON (repeat); default: default={}")
    args = parser.parse_args()
    configs = dict(c.split("=", 1) for c in args.config) or {"default": "{}"}
    servers: dict[str, Server] = {}
    try:
        for name, text in configs.items():
            config = json.loads(text)
            servers[name] = Server(args.engine, Path(f"/tmp/bench-hostile-{name}.log"), *SERVE,
                                   *config.get("args", []), env=config.get("env", {}))
            hostile.Trickle(servers[name].url, count=10).run()  # first-request costs are no baseline's
        for r in range(args.rounds):
            for name, server in servers.items():
                alone, under, count = one_round(server, GROUPS[args.group])
                print(f"round {r} {name} {args.group}: trickle p99 alone {alone * 1e3:.1f} ms, under the mix "
                      f"{under * 1e3:.1f} ms (x{under / alone:.1f}, {count} requests)", flush=True)
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
