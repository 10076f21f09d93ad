"""Build real-shape random-weight models with `kiln build` and record each child's wall time and peak RSS.

    .venv/bin/python benchmarks/scale/run.py --shapes llama-3.2-1b,llama-3.2-3b [--sources hf,gguf]
        [--dir /tmp/kiln-scale] [--quantization int4-q4_1] [--results benchmarks/scale/results.jsonl]

Per shape and source: write the checkpoint (hf: bf16 safetensors shard by shard; gguf: random Q4_K_M-like
blocks tensor by tensor, checkpoints.py; llamacpp: the hf dir converted by llama.cpp's convert_hf_to_gguf.py and
llama-quantize Q4_K_M, both measured, where benchmarks/peers/setup.py has built them), `kiln build` it in a child
process (peak RSS: the child's ru_maxrss from wait4), `kiln generate ENGINE --max-tokens 8` to check the engine
runs, then delete checkpoint and engine before the next (an 8B bf16 checkpoint is 15 GB; --keep-engine keeps the
engine and llama.cpp's Q4_K_M file). One JSON line per build goes to --results; a markdown table is printed at the
end. --keep-checkpoint keeps the checkpoint too (the hf dir the other peers export from).
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from checkpoints import (  # noqa: E402
    GGUF_FAMILIES,
    SHAPES,
    copy_gguf_tokenizer,
    write_checkpoint,
    write_random_gguf,
    write_smollm2_tokenizer,
)
from layout import PeerLayout, default_scratch  # noqa: E402

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


def llama_cpp_q4_k_m(hf_dir: Path, log_prefix: Path) -> tuple[Path, dict]:
    """llama.cpp's own conversion of hf_dir: convert_hf_to_gguf.py to f16, llama-quantize to Q4_K_M (the f16 file is
    deleted); returns the Q4_K_M file and the two steps' wall and peak RSS."""
    lay = PeerLayout(default_scratch())
    f16, q4 = hf_dir / "model-f16.gguf", hf_dir / "model-Q4_K_M.gguf"
    code, wall, rss = measure([sys.executable, str(lay.llama_src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype",
                               "f16", "--outfile", str(f16)], Path(f"{log_prefix}-convert.log"))
    if code:
        raise RuntimeError(f"convert_hf_to_gguf.py failed; see {log_prefix}-convert.log")
    qcode, qwall, qrss = measure([str(lay.llama_tool("llama-quantize")), str(f16), str(q4), "Q4_K_M"],
                                 Path(f"{log_prefix}-quantize.log"))
    f16.unlink()
    if qcode:
        raise RuntimeError(f"llama-quantize failed; see {log_prefix}-quantize.log")
    return q4, {"convert_wall_s": round(wall, 1), "convert_peak_rss_gib": round(rss, 2),
                "quantize_wall_s": round(qwall, 1), "quantize_peak_rss_gib": round(qrss, 2)}


def llama_cpp_available() -> bool:
    lay = PeerLayout(default_scratch())
    return (lay.llama_src / "convert_hf_to_gguf.py").is_file() and lay.llama_tool("llama-quantize").is_file()


def run_one(name: str, source: str, quantization: str, work: Path, keep_engine: bool = False,
            keep_checkpoint: bool = False) -> dict:
    from kiln.export.checkpoint import default_model_path

    shape = SHAPES[name]
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"{name}-{source}"
    engine = work / f"{name}-{source}-engine"
    shutil.rmtree(engine, ignore_errors=True)
    start = time.perf_counter()
    peers: dict = {}
    if source in ("hf", "llamacpp"):
        write_checkpoint(shape, model)
        write_smollm2_tokenizer(model)
        model_path = model
        if source == "llamacpp":
            model_path, peers = llama_cpp_q4_k_m(model, work / f"{name}-{source}")
            if keep_engine:  # the peers are measured on the same file
                model_path = model_path.rename(work / f"{name}-Q4_K_M.gguf")
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
    result.update(peers)
    if not keep_checkpoint:
        shutil.rmtree(model, ignore_errors=True)
    if code == 0:
        result["engine_gib"] = round(engine_bytes(engine) / 2**30, 2)
        gcode, gwall, grss = measure([str(KILN), "generate", str(engine), "Hello", "--max-tokens", "8"],
                                     work / f"{name}-{source}-generate.log")
        result.update({"generate_exit": gcode, "generate_wall_s": round(gwall, 1),
                       "generate_peak_rss_gib": round(grss, 2)})
    if not keep_engine:
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
    parser.add_argument("--sources", default="hf,gguf,llamacpp",
                        help="hf (bf16 safetensors), gguf (random Q4_K_M-like blocks), llamacpp (the hf checkpoint "
                             "through llama.cpp's convert_hf_to_gguf.py and llama-quantize Q4_K_M, when set up)")
    parser.add_argument("--quantization", default="int4-q4_1")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kiln-scale"))
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("results.jsonl"))
    parser.add_argument("--keep-engine", action="store_true",
                        help="leave each built engine in --dir (for serve_first_token.py), and llama.cpp's Q4_K_M "
                             "file beside it (NAME-Q4_K_M.gguf, for the peers); checkpoints are deleted")
    parser.add_argument("--keep-checkpoint", action="store_true",
                        help="leave each written checkpoint in --dir (NAME-SOURCE: the hf dir that onnxruntime-genai's "
                             "builder and OpenVINO's export read, for peers.py)")
    args = parser.parse_args()
    results = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {list(SHAPES)}")
        for source in args.sources.split(","):
            if source == "llamacpp" and not llama_cpp_available():
                print("[scale] no llama.cpp converter here: run benchmarks/peers/setup.py (it builds llama-quantize)")
                continue
            if source == "gguf" and SHAPES[name].family not in GGUF_FAMILIES:
                print(f"[scale] {name}: no gguf source (random GGUF files are written for {GGUF_FAMILIES} only)")
                continue
            result = run_one(name, source, args.quantization, args.dir, args.keep_engine,
                             args.keep_checkpoint)
            results.append(result)
            with args.results.open("a") as out:
                out.write(json.dumps(result) + "\n")
    print(table(results))
    return 0 if all(r["build_exit"] == 0 and r.get("generate_exit") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
