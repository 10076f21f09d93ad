"""One real shape against every peer: kiln, llama.cpp, onnxruntime-genai and OpenVINO GenAI in interleaved rounds.

    KILN_PEERS_DIR=DIR .venv/bin/python benchmarks/scale/peers.py --hf HF_DIR --gguf Q4_K_M.gguf --engine ENGINE
        [--rounds 3] [--threads 2] [--systems kiln,llamacpp,ort-genai,openvino] [--out OUT_DIR]

HF_DIR, the GGUF and the engine come from `benchmarks/scale/run.py --sources llamacpp --quantization gguf
--keep-engine --keep-checkpoint`. The peers' own models are built from HF_DIR when absent (beside it):
onnxruntime-genai's builder `-p int4 -e cpu` (MatMulNBits, block 32) in the venv benchmarks/peers/setup.py made,
and OpenVINO's `optimum-cli export openvino --weight-format int4 --group-size 32 --ratio 1.0` in DIR/openvino-venv.
That venv is made by hand: `python3 -m venv DIR/openvino-venv`, a .pth file in its site-packages naming kiln's venv's
site-packages (its CPU torch), then `pip install openvino-genai==2026.4.1.0 openvino-tokenizers
"optimum-intel[openvino]" nncf "torch==2.13.0"` (without the torch pin pip pulls a CUDA torch through torchvision)
and `pip uninstall -y torchvision` (the version pip picks against torch 2.13 breaks `import transformers`; the
export does not need it).

Four figures a system and round, every one at --threads threads:
  decode_1    single-stream decode tok/s after a short prompt (kiln bench: 16 tokens in, 64 out; llama-bench tg64;
              the Python peers: 16 in, 128 out), the first token's time excluded;
  prefill_512 a 512-token prompt's tokens over the time to its first token (llama-bench pp512);
  agg_16      16 x (128 in, 128 out) at once: generated tokens over the whole run, prefill included;
  decode_4k   single-stream decode after a 4096-token prompt (kiln bench's median inter-token time;
              llama-bench -d 4096 tg64; the Python peers: 128 tokens); --long-context sets another length
              (a model trained on 4096 tokens, whose prompt and 64 generated ones must fit: 4000).
Each round runs the systems one after another (the order rotates a round); one JSON line a system and round goes
to OUT/results.jsonl and a markdown table of median [min-max] with kiln / best peer to OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from layout import PeerLayout, dangling_package_paths, default_scratch  # noqa: E402
from llama import batched_bench_cmd, parse_batched_bench, run_tool  # noqa: E402

KILN = Path(sys.executable).with_name("kiln")
HERE = Path(__file__).resolve().parent
FIGURES = ("decode_1", "prefill_512", "agg_16", "decode_4k")
LABELS = {"decode_1": "single-stream decode (tok/s)", "prefill_512": "prefill 512 (tok/s)",
          "agg_16": "16 x (128 in, 128 out), generated tok/s", "decode_4k": "decode at 4k context (tok/s)"}
SYSTEMS = ("kiln", "llamacpp", "ort-genai", "openvino")
DEFAULT_LONG_CONTEXT = 4096


def say(msg: str) -> None:
    print(f"[peers] {time.strftime('%H:%M:%S')} {msg}", flush=True)


def dir_bytes(path: Path, suffixes: tuple[str, ...]) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name.endswith(suffixes))


def build_peer_models(hf: Path, lay: PeerLayout, systems: list[str]) -> dict[str, Path]:
    """The peers' models beside HF_DIR, built from it where absent (each build's log beside it)."""
    models = {"ort-genai": hf.with_name(hf.name + "-ort-genai-int4"), "openvino": hf.with_name(hf.name + "-ov-int4")}
    commands = {
        "ort-genai": [str(lay.venv_python), "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o",
                      str(models["ort-genai"]), "-p", "int4", "-e", "cpu", "-c", str(lay.root / "builder-cache")],
        "openvino": [str(lay.root / "openvino-venv" / "bin" / "optimum-cli"), "export", "openvino", "-m", str(hf),
                     "--task", "text-generation-with-past", "--weight-format", "int4", "--group-size", "32",
                     "--ratio", "1.0", str(models["openvino"])],
    }
    for name in ("ort-genai", "openvino"):
        if name in systems and not models[name].is_dir():
            say(f"building the {name} model: {' '.join(commands[name])}")
            with open(f"{models[name]}.log", "w") as log:
                subprocess.run(["nice", "-n", "19", *commands[name]], check=True, stdout=log, stderr=subprocess.STDOUT)
    return models


def kiln_round(engine: Path, threads: int, tmp: Path, long_context: int) -> dict:
    def bench(extra: list[str], name: str) -> dict:
        out = tmp / name
        subprocess.run([str(KILN), "bench", str(engine), "--num-threads", str(threads), "--json", str(out), *extra],
                       check=True, capture_output=True, text=True)
        return json.loads(out.read_text())

    main = bench(["--num-requests", "16", "--input-len", "128", "--output-len", "128"], "kiln.json")
    long = bench(["--num-requests", "1", "--input-len", str(long_context), "--output-len", "64"], "kiln-4k.json")
    single = main["single_stream"]
    return {"decode_1": single["decode_tok_per_s"], "prefill_512": single["prefill_512_tok_per_s"],
            "agg_16": main["runs"][0]["output_tok_per_s"], "decode_4k": 1000 / long["runs"][0]["itl_ms"]["p50"],
            "floor_tok_per_s": main["bandwidth_bound_decode_tok_per_s"],
            "floor_pct": 100 * single["decode_tok_per_s"] / main["bandwidth_bound_decode_tok_per_s"],
            "read_gbps": main["memory_bandwidth"]["read_gbps"],
            "weight_bytes_per_token": main["weight_bytes_per_token"]}


def llama_round(lay: PeerLayout, gguf: Path, threads: int, long_context: int) -> dict:
    bench = [str(lay.llama_tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    short = json.loads(run_tool([*bench, "-p", "512", "-n", "64"]))
    long = json.loads(run_tool([*bench, "-p", "0", "-n", "64", "-d", str(long_context)]))
    rate = {(int(t["n_prompt"]), int(t["n_gen"]), int(t.get("n_depth", 0))): float(t["avg_ts"]) for t in short + long}
    batched = parse_batched_bench(run_tool(batched_bench_cmd(lay.llama_tool("llama-batched-bench"), gguf, threads,
                                                             128, 128, 16)))
    return {"decode_1": rate[(0, 64, 0)], "prefill_512": rate[(512, 0, 0)],
            "agg_16": batched[16]["aggregate_tok_per_s"], "decode_4k": rate[(0, 64, long_context)]}


def check_peer_venvs(lay: PeerLayout, systems: list[str]) -> None:
    """Refuses, before any round, a Python peer whose venv borrows packages from a folder that is gone."""
    venvs = {"ort-genai": lay.venv, "openvino": lay.root / "openvino-venv"}
    for system in systems:
        if system in venvs and (dangling := dangling_package_paths(venvs[system])):
            here = sysconfig.get_paths()["purelib"]
            raise SystemExit(f"{system}'s venv {venvs[system]} reads packages from folders that are gone "
                             f"({'; '.join(dangling)}): write kiln's venv's site-packages ({here}) in their place")


def python_peer_round(python: Path, driver: Path, model: Path, threads: int, prompts: dict, tmp: Path,
                      **options) -> dict:
    work = tmp / "workload.json"
    work.write_text(json.dumps({**options, "model": str(model), "threads": threads, "output_len": 128,
                                "prefill_prompt": prompts["prefill"], "single_prompt": prompts["single"],
                                "batches": [prompts["batch16"], [prompts["long"]]]}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), str(driver), str(work)], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{driver.name} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    figures = {"decode_1": out["decode_tok_per_s"], "prefill_512": out["prefill_tok_per_s"],
               "agg_16": out["batches"]["16"]["aggregate_tok_per_s"],
               "decode_4k": out["batches"]["1"]["decode_tok_per_s"]}
    if "inference_precision" in out:
        figures["inference_precision"] = out["inference_precision"]
    return figures


def workload_prompts(vocab: int, long_context: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab, n).tolist()

    return {"single": ids(16), "prefill": ids(512), "batch16": [ids(128) for _ in range(16)], "long": ids(long_context)}


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}–{max(values):.1f}]"


def table(rows: list[dict], weights: dict[str, str]) -> str:
    """Median [min-max] per system and figure; kiln / best peer per round, its median [min-max]."""
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    lines = ["| | " + " | ".join(systems) + " | kiln / best peer |", "|---" * (len(systems) + 2) + "|",
             "| weights | " + " | ".join(weights.get(s, "-") for s in systems) + " | |"]
    rounds = sorted({r["round"] for r in rows})
    for fig in FIGURES:
        cells = []
        for s in systems:
            vals = [r[fig] for r in rows if r["system"] == s and fig in r]
            cells.append(fmt(vals) if vals else "-")
        ratios = []
        for rnd in rounds:
            this = {r["system"]: r[fig] for r in rows if r["round"] == rnd and fig in r}
            peers = [v for s, v in this.items() if s != "kiln"]
            if "kiln" in this and peers:
                ratios.append(this["kiln"] / max(peers))
        ratio = f"{statistics.median(ratios):.2f}× [{min(ratios):.2f}–{max(ratios):.2f}]" if ratios else "-"
        lines.append(f"| {LABELS[fig]} | " + " | ".join(cells) + f" | {ratio} |")
    floor = [r["floor_pct"] for r in rows if r["system"] == "kiln"]
    if floor:
        lines.append(f"\nkiln's single-stream decode: {fmt(floor)} % of `kiln bench`'s bandwidth floor.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", type=Path, required=True, help="the shape's Hugging Face checkpoint dir")
    parser.add_argument("--gguf", type=Path, required=True, help="llama.cpp's Q4_K_M file of it")
    parser.add_argument("--engine", type=Path, required=True, help="kiln's engine built from the GGUF")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kiln-scale-peers"))
    parser.add_argument("--openvino-precision", default=None,
                        help="OpenVINO's INFERENCE_PRECISION_HINT (e.g. f32; default: the plugin's, bf16 on AVX-512 "
                             "BF16 and AMX CPUs)")
    parser.add_argument("--long-context", type=int, default=DEFAULT_LONG_CONTEXT,
                        help="the prompt length of the decode_4k figure")
    args = parser.parse_args()
    ov_options = {"precision": args.openvino_precision} if args.openvino_precision else {}
    systems = args.systems.split(",")
    lay = PeerLayout(default_scratch())
    check_peer_venvs(lay, systems)
    models = build_peer_models(args.hf, lay, systems)
    vocab = json.loads((args.hf / "config.json").read_text())["vocab_size"]
    prompts = workload_prompts(vocab, args.long_context)
    weights = {"kiln": f"{dir_bytes(args.engine, ('',)) / 2**20:.0f} MiB (engine dir)",
               "llamacpp": f"{args.gguf.stat().st_size / 2**20:.0f} MiB (GGUF)"}
    if "ort-genai" in systems:
        weights["ort-genai"] = f"{dir_bytes(models['ort-genai'], ('.onnx', '.onnx.data')) / 2**20:.0f} MiB (onnx)"
    if "openvino" in systems:
        weights["openvino"] = f"{dir_bytes(models['openvino'], ('openvino_model.bin',)) / 2**20:.0f} MiB (bin)"
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for rnd in range(args.rounds):
            order = systems[rnd % len(systems):] + systems[: rnd % len(systems)]
            for system in order:
                say(f"round {rnd + 1}: {system} (load {os.getloadavg()[0]:.1f})")
                if system == "kiln":
                    figures = kiln_round(args.engine, args.threads, tmp, args.long_context)
                elif system == "llamacpp":
                    figures = llama_round(lay, args.gguf, args.threads, args.long_context)
                elif system == "ort-genai":
                    figures = python_peer_round(lay.venv_python, HERE.parent / "peers" / "ort_genai_driver.py",
                                                models["ort-genai"], args.threads, prompts, tmp)
                else:
                    figures = python_peer_round(lay.root / "openvino-venv" / "bin" / "python",
                                                HERE / "openvino_driver.py", models["openvino"], args.threads,
                                                prompts, tmp, **ov_options)
                row = {"round": rnd + 1, "system": system, **figures, "threads": args.threads,
                       "host_load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
                say(json.dumps(row))
                rows.append(row)
                with results.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    text = table(rows, weights)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
