"""kiln against onnxruntime-genai and llama.cpp in interleaved rounds (run setup.py first).

    .venv/bin/python benchmarks/peers/run.py --kiln-engine w8a8=engines/w8a8 [--kiln-engine NAME=DIR ...] [--plot DIR]

Each round runs every system back to back (this machine's speed drifts 10–30% within minutes, so
kiln/peer ratios are taken within a round), first the offline shapes, then the serving load:
  - prefill of a 512-token prompt; single-stream decode of 128 tokens after a 37-token chat prompt;
    16 and 32 chat prompts x 128 tokens, aggregate (prefill included) and decode only;
    kiln in-process (Engine, 2 threads), onnxruntime-genai's int4 CPU model through a driver in its own
    venv, llama.cpp through llama-bench (prefill) and llama-batched-bench (the rest), all greedy, EOS ignored;
  - serving: 64 requests of 200 random prompt tokens, 128 output tokens, 16 in flight, streaming
    /v1/completions against `llama-server -np 16 -cb` and `kiln serve`: output tok/s from the servers'
    usage counts, TTFT median and p90, TPOT median.
Prints one table (medians per system; kiln/peer ratios, median [min–max] over rounds) and writes JSON.
`kiln serve` runs with ONNX Runtime's default thread count (one per core): on a machine with more cores
than --threads its serving figures are not like for like.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import kiln_side
import llama
import report
import servers
from layout import LLAMA_TOOLS, PeerLayout, default_scratch
from workload import Workload, make_workload

from kiln.export.checkpoint import default_model_path
from kiln.runtime.ops import cpuinfo_field, library_variant
from kiln.runtime.tokenizer import Tokenizer

ORT_GENAI, LLAMA_CPP = "ort-genai int4", "llama.cpp Q4_1"
SERVING_FIGURES = [
    report.Figure("serve_output_tok_s", "serving: output", "tok/s"),
    report.Figure("serve_ttft_p50_s", "serving: TTFT median", "s"),
    report.Figure("serve_ttft_p90_s", "serving: TTFT p90", "s"),
    report.Figure("serve_tpot_p50_ms", "serving: TPOT median", "ms"),
    report.Figure("serve_failed", "serving: failed requests (dropped connections)", "count"),
]


def say(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def offline_figures(work: Workload) -> list[report.Figure]:
    figures = [report.Figure("prefill_512", f"prefill, {len(work.prefill_prompt)}-token prompt", "tok/s"),
               report.Figure("decode_1", f"single-stream decode, {work.output_len} tokens after a "
                             f"{len(work.single_prompt)}-token chat prompt", "tok/s")]
    for size in work.batches:
        figures += [report.Figure(f"batch{size}_aggregate", f"{size} chat prompts × {work.output_len} tokens, "
                                  "aggregate incl. prefill", "tok/s"),
                    report.Figure(f"batch{size}_decode", "same, decode only", "tok/s")]
    return figures


def ort_genai_figures(lay: PeerLayout, work: Workload, threads: int) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
        json.dump({"model": str(lay.ort_genai_model), "threads": threads, **work.as_json()}, spec)
        spec.flush()
        driver = Path(__file__).with_name("ort_genai_driver.py")
        out = json.loads(llama.run_tool([str(lay.venv_python), str(driver), spec.name]))
    figures = {"prefill_512": out["prefill_tok_per_s"], "decode_1": out["decode_tok_per_s"]}
    for size, run in out["batches"].items():
        figures[f"batch{size}_aggregate"] = run["aggregate_tok_per_s"]
        figures[f"batch{size}_decode"] = run["decode_tok_per_s"]
    return figures


def llama_figures(lay: PeerLayout, gguf: Path, work: Workload, threads: int) -> dict[str, float]:
    bench = llama.parse_llama_bench(llama.run_tool(
        llama.llama_bench_cmd(lay.llama_tool("llama-bench"), gguf, threads, len(work.prefill_prompt))))
    batched = lay.llama_tool("llama-batched-bench")
    single = llama.parse_batched_bench(llama.run_tool(
        llama.batched_bench_cmd(batched, gguf, threads, len(work.single_prompt), work.output_len, 1)))
    figures = {"prefill_512": bench[len(work.prefill_prompt)], "decode_1": single[1]["decode_tok_per_s"]}
    for size, prompts in work.batches.items():
        # One prompt length for every sequence (the tool's limit): the batch's mean chat-prompt length.
        mean_len = round(sum(map(len, prompts)) / len(prompts))
        run = llama.parse_batched_bench(llama.run_tool(
            llama.batched_bench_cmd(batched, gguf, threads, mean_len, work.output_len, size)))[size]
        figures[f"batch{size}_aggregate"] = run["aggregate_tok_per_s"]
        figures[f"batch{size}_decode"] = run["decode_tok_per_s"]
    return figures


def parse_engines(specs: list[str]) -> dict[str, Path]:
    engines = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not (Path(folder) / "manifest.json").is_file():
            raise SystemExit(f"--kiln-engine {spec!r}: expected NAME=DIR with DIR an engine directory (manifest.json)")
        engines[f"kiln {name}"] = Path(folder)
    return engines


def check_setup(lay: PeerLayout) -> None:
    missing = [p for p in (lay.venv_python, lay.ort_genai_model / "genai_config.json",
                           *(lay.llama_tool(t) for t in LLAMA_TOOLS)) if not p.exists()]
    if missing:
        raise SystemExit(f"the peers are not set up ({missing[0]} is missing): run benchmarks/peers/setup.py first")


def one_round(args, lay: PeerLayout, engines: dict[str, Path], work: Workload, load: servers.ServingLoad | None):
    gguf, vocab = default_model_path(), Tokenizer(lay.hf_checkpoint).vocab_size
    offline = {ORT_GENAI: lambda: ort_genai_figures(lay, work, args.threads),
               LLAMA_CPP: lambda: llama_figures(lay, gguf, work, args.threads),
               **{name: (lambda d=d: kiln_side.measure(d, work, args.threads)) for name, d in engines.items()}}
    figures: dict[str, dict[str, float]] = {}
    for system, measure in offline.items():
        say(f"  {system}: offline shapes ...")
        start = time.perf_counter()
        figures[system] = measure()
        say(f"  {system}: done in {time.perf_counter() - start:.0f} s: " +
            ", ".join(f"{k} {v:.1f}" for k, v in figures[system].items()))
    if load is None:
        return figures
    kiln_bin = Path(sys.executable).with_name("kiln")
    commands = {LLAMA_CPP: lambda port: llama.server_cmd(lay.llama_tool("llama-server"), gguf, args.threads, port,
                                                         load.concurrency),
                **{name: (lambda port, d=d: servers.kiln_serve_cmd(kiln_bin, d, port)) for name, d in engines.items()}}
    for system, command in commands.items():
        say(f"  {system}: serving {load.num_requests} requests, {load.concurrency} in flight ...")
        port = servers.free_port()
        log = lay.root / f"server-{system.replace(' ', '_')}.log"
        start = time.perf_counter()
        with servers.running_server(command(port), port, log) as url:
            figures[system].update(servers.measure_server(url, load, vocab))
        say(f"  {system}: done in {time.perf_counter() - start:.0f} s: " +
            ", ".join(f"{k} {v:.2f}" for k, v in figures[system].items() if k.startswith("serve")))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kiln-engine", action="append", required=True, metavar="NAME=DIR",
                        help="a kiln engine directory, named as its column (repeatable)")
    parser.add_argument("--dir", type=Path, default=default_scratch(), help="the scratch directory setup.py filled")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batches", default="16,32", help="batch sizes of the chat-prompt shapes")
    parser.add_argument("--serve-requests", type=int, default=64, help="requests of the serving load (0: skip it)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the JSON (default: in --dir)")
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR",
                        help="also write DIR/ratios.png, the ratios as a grouped bar chart (needs kiln[plot])")
    args = parser.parse_args()
    if args.plot:
        import plot  # fails here, not after an hour of rounds, where matplotlib is missing
    lay = PeerLayout(args.dir.expanduser().resolve())
    check_setup(lay)
    engines = parse_engines(args.kiln_engine)
    work = make_workload(Tokenizer(lay.hf_checkpoint), [int(b) for b in args.batches.split(",")], args.output_len)
    load = servers.ServingLoad(num_requests=args.serve_requests, output_len=args.output_len) \
        if args.serve_requests else None
    rounds: report.Rounds = []
    started = time.perf_counter()
    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}")
        rounds.append(one_round(args, lay, engines, work, load))
    figures = offline_figures(work) + (SERVING_FIGURES if load else [])
    kiln, peers = list(engines), [ORT_GENAI, LLAMA_CPP]
    text = report.table(rounds, figures, kiln, peers)
    # a figure means little without the CPU: this project's machine has changed CPU between sessions
    machine = {"cpu": cpuinfo_field("model name") or "unknown", "kiln_kernels": library_variant()}
    print(f"\n{args.rounds} interleaved rounds, {args.threads} threads, {time.perf_counter() - started:.0f} s; "
          f"{machine['cpu']}, kiln kernels {machine['kiln_kernels']}\n")
    print(text)
    out = args.json or lay.root / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
    result = {
        "engines": {k: str(v) for k, v in engines.items()}, "threads": args.threads, **machine, "rounds": rounds,
        "serving_load": load.__dict__ if load else None, "workload_prompt_lengths": {
            "prefill": len(work.prefill_prompt), "single": len(work.single_prompt),
            **{f"batch{b}": [len(p) for p in ps] for b, ps in work.batches.items()}},
        "figures": {f.key: {"label": f.label, "unit": f.unit} for f in figures},
        "summary": report.summary(rounds, figures, kiln, peers)}
    out.write_text(json.dumps(result, indent=2))
    say(f"JSON written to {out}")
    if args.plot:
        say(f"chart written to {plot.write_ratio_chart(result, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
