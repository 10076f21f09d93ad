"""How long another thread (the server's event loop, in effect) waits to get the GIL back after a blocking call
while the engine thread steps 16 sequences back to back, for a few `sys.setswitchinterval` values; and the
engine's steps per second meanwhile (what a shorter interval would cost it).

    python benchmarks/bench_gil_handover.py ENGINE_DIR [--rounds 3]

The waiting thread sleeps 0.5 ms 300 times (a sleep releases the GIL as a socket call does); its wait is the
time past the 0.5 ms. Intervals are interleaved within each round (the machine drifts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from kiln.runtime.llm import LLM
from kiln.runtime.params import SamplingParams

INTERVALS = (0.005, 0.001, 0.0005)  # 5 ms is CPython's default


def keep_stepping(llm: LLM, stop: threading.Event, steps: list[int]) -> None:
    """16 sequences at all times (a finished one replaced), stepped until `stop`."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    live: set[str] = set()
    count = 0
    while not stop.is_set():
        while len(live) < 16:
            count += 1
            live.add(request_id := f"gil-{count}")
            engine.add(engine.prepare(request_id, "hello there how are you", params))
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        steps[0] += 1
    for request_id in live:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()


def measure(llm: LLM, interval: float) -> tuple[float, float, float]:
    """(median wait, p99 wait, engine steps/s) under this switch interval."""
    sys.setswitchinterval(interval)
    stop, steps = threading.Event(), [0]
    thread = threading.Thread(target=keep_stepping, args=(llm, stop, steps))
    thread.start()
    time.sleep(0.3)
    waits = []
    start, first = time.perf_counter(), steps[0]
    for _ in range(300):
        t = time.perf_counter()
        time.sleep(0.0005)
        waits.append(time.perf_counter() - t - 0.0005)
    rate = (steps[0] - first) / (time.perf_counter() - start)
    stop.set()
    thread.join()
    waits.sort()
    return statistics.median(waits), waits[int(0.99 * len(waits))], rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.engine)
    for r in range(args.rounds):
        for interval in INTERVALS:
            median, p99, rate = measure(llm, interval)
            print(f"round {r} switch interval {interval * 1e3:.1f} ms: GIL wait median {median * 1e3:.2f} ms, "
                  f"p99 {p99 * 1e3:.2f} ms; engine {rate:.0f} steps/s", flush=True)


if __name__ == "__main__":
    main()
