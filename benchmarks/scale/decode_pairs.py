"""Single-stream decode of kiln and llama.cpp on the same GGUF, alternated run by run.

    KILN_PEERS_DIR=DIR .venv/bin/python benchmarks/scale/decode_pairs.py --gguf Q4_K_M.gguf --engine ENGINE
        [--pairs 8] [--threads 2] [--out OUT.jsonl]

Decode is bound by memory bandwidth, and on a shared host that bandwidth moves by 1.5x within minutes (`kiln bench`'s
numpy probe: 30-44 GB/s in one half hour), more than the two systems differ: peers.py's rounds, a system's whole set
of figures at a time, put minutes between the decode runs they compare. Here kiln's engine is loaded once and each
pair is one `kiln bench`-style single stream (16 tokens in, 64 out, the first token's time excluded) and one
`llama-bench -p 0 -n 64` seconds apart, the order swapped every pair; the ratio of each pair is its own sitting. The
read probe runs between pairs, so each line shows what the host gave.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from layout import PeerLayout, default_scratch  # noqa: E402
from llama import run_tool  # noqa: E402


def llama_decode(lay: PeerLayout, gguf: Path, threads: int) -> float:
    """llama-bench's tg64 tok/s."""
    cmd = [str(lay.llama_tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
           "-p", "0", "-n", "64"]
    return float(json.loads(run_tool(cmd))[0]["avg_ts"])


def summary(pairs: list[dict]) -> str:
    """Each system's median [min-max] tok/s and the pairs' kiln / llama.cpp ratio, median [min-max]."""
    def fmt(values: list[float], unit: str) -> str:
        return f"{statistics.median(values):.2f}{unit} [{min(values):.2f}–{max(values):.2f}]"

    ratios = [p["kiln"] / p["llamacpp"] for p in pairs]
    return (f"{len(pairs)} pairs: kiln {fmt([p['kiln'] for p in pairs], '')} tok/s, llama.cpp "
            f"{fmt([p['llamacpp'] for p in pairs], '')} tok/s, kiln / llama.cpp {fmt(ratios, '×')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="the GGUF llama.cpp runs")
    parser.add_argument("--engine", type=Path, required=True, help="kiln's engine built from it")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line a pair here")
    args = parser.parse_args()

    from kiln.runtime.bench.offline import memory_bandwidth_gbps, single_stream
    from kiln.runtime.loader import load_engine
    from kiln.runtime.params import RuntimeConfig

    lay = PeerLayout(default_scratch())
    engine = load_engine(args.engine, RuntimeConfig(num_threads=args.threads, enable_prefix_caching=False))
    single_stream(engine)  # warm-up: the engine's pages and the session's first runs
    llama_decode(lay, args.gguf, args.threads)
    pairs = []
    for i in range(args.pairs):
        read_gbps = memory_bandwidth_gbps()["read_gbps"]
        runs = {}
        for system in ("kiln", "llamacpp") if i % 2 == 0 else ("llamacpp", "kiln"):
            runs[system] = (single_stream(engine)["decode_tok_per_s"] if system == "kiln"
                            else llama_decode(lay, args.gguf, args.threads))
        pair = {"pair": i + 1, **runs, "ratio": runs["kiln"] / runs["llamacpp"], "read_gbps": read_gbps,
                "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        print(f"pair {i + 1}: kiln {runs['kiln']:.2f}, llama.cpp {runs['llamacpp']:.2f} tok/s, "
              f"{pair['ratio']:.3f}× (read probe {read_gbps} GB/s)", flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(pair) + "\n")
        pairs.append(pair)
    print(summary(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
