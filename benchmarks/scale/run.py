"""Build real-shape random-weight models with `kiln build` and record each child's wall time and peak RSS.

    .venv/bin/python benchmarks/scale/run.py --shapes llama-3.2-1b,llama-3.2-3b [--sources hf,gguf]
        [--dir /tmp/kiln-scale] [--quantization int4-q4_1] [--results benchmarks/scale/results.jsonl]

Per shape and source: write the checkpoint (hf: bf16 safetensors shard by shard; gguf: random Q4_K_M-like blocks
tensor by tensor, checkpoints.py), `kiln build` it in a child process (peak RSS: the child's ru_maxrss from wait4),
`kiln generate ENGINE --max-tokens 8` to check the engine runs, then delete checkpoint and engine before the next
(an 8B bf16 checkpoint is 15 GB). One JSON line per build goes to --results; a markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import SHAPES, copy_gguf_tokenizer, write_checkpoint, write_random_gguf, write_smollm2_tokenizer  # noqa: E402

KILN = Path(sys.executable).with_name("kiln")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def measure(cmd: list[str], log: Path) -> tuple[int, float, float]:
    """(exit code, wall seconds, peak RSS in GiB) of cmd as a child."""
    start = time.perf_counter()
    with log.open("w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, time.perf_counter() - start, usage.ru_maxrss / 2**20


def engine_bytes(engine: Path) -> int:
    return sum(f.stat().st_size for f in engine.iterdir() if f.is_file())


def run_one(name: str, source: str, quantization: str, work: Path) -> dict:
    from kiln.export.checkpoint import default_model_path

    shape = SHAPES[name]
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"{name}-{source}"
    engine = work / f"{name}-{source}-engine"
    shutil.rmtree(engine, ignore_errors=True)
    start = time.perf_counter()
    if source == "hf":
        write_checkpoint(shape, model)
        write_smollm2_tokenizer(model)
        model_path = model
    else:
        model.mkdir(parents=True, exist_ok=True)
        model_path = model / "model.gguf"
        write_random_gguf(shape, model_path, copy_gguf_tokenizer(default_model_path()))
    written = time.perf_counter() - start
    print(f"[scale] {name} {source}: checkpoint written in {written:.0f}s", flush=True)
    code, wall, rss = measure(["nice", str(KILN), "build", str(model_path), "-o", str(engine), "--quantization",
                               quantization], work / f"{name}-{source}-build.log")
    result = {"shape": name, "params": shape.parameters(), "source": source, "quantization": quantization,
              "build_exit": code, "build_wall_s": round(wall, 1), "build_peak_rss_gib": round(rss, 2),
              "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "host_load": os.getloadavg()[0]}
    shutil.rmtree(model, ignore_errors=True)
    if code == 0:
        result["engine_gib"] = round(engine_bytes(engine) / 2**30, 2)
        gcode, gwall, grss = measure([str(KILN), "generate", str(engine), "Hello", "--max-tokens", "8"],
                                     work / f"{name}-{source}-generate.log")
        result.update({"generate_exit": gcode, "generate_wall_s": round(gwall, 1),
                       "generate_peak_rss_gib": round(grss, 2)})
    shutil.rmtree(engine, ignore_errors=True)
    print(f"[scale] {json.dumps(result)}", flush=True)
    return result


def table(results: list[dict]) -> str:
    lines = ["| shape (params) | source | build wall | build peak RSS | engine | bound (engine + 4 GB) | generates |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        engine = r.get("engine_gib")
        bound = f"{engine + 4:.1f} GiB" if engine is not None else "-"
        lines.append(f"| {r['shape']} ({r['params'] / 1e9:.2f}B) | {r['source']} {r['quantization']} | "
                     f"{r['build_wall_s'] / 60:.1f} min | {r['build_peak_rss_gib']:.2f} GiB | "
                     f"{engine if engine is not None else '-'} GiB | {bound} | "
                     f"{'yes' if r.get('generate_exit') == 0 else 'no'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.2-3b", help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--sources", default="hf,gguf", help="hf (bf16 safetensors) and/or gguf (random Q4_K_M-like)")
    parser.add_argument("--quantization", default="int4-q4_1")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kiln-scale"))
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("results.jsonl"))
    args = parser.parse_args()
    results = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {list(SHAPES)}")
        for source in args.sources.split(","):
            if source == "gguf" and SHAPES[name].family != "llama":
                print(f"[scale] {name}: no gguf source (kiln reads llama-architecture GGUF files only)")
                continue
            result = run_one(name, source, args.quantization, args.dir)
            results.append(result)
            with args.results.open("a") as out:
                out.write(json.dumps(result) + "\n")
    print(table(results))
    return 0 if all(r["build_exit"] == 0 and r.get("generate_exit") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
