"""llama.cpp as a peer: the command lines of llama-bench / llama-batched-bench and the parsing of their output.

llama-bench gives prefill (pp512); llama-batched-bench gives single-stream decode after a chat-length
prompt (npl 1) and the 16- and 32-way figures. Its "speed" counts prompt tokens too, so the aggregate
here is generated tokens over the whole time (pl * tg / t), the figure measured for kiln and onnxruntime-genai.
Both the batched bench and the server run with one unified KV cache (-kvu): with one cache per sequence
(their default once the parallel count is given) the 16-way decode measured 3x slower on this machine.
Each parallel count gets its own llama-batched-bench process: run after the 16-way one in the same
process, the 32-way decode measured 78 tok/s against 349 alone.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def llama_bench_cmd(binary: Path, gguf: Path, threads: int, prompt_len: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt_len), "-n", "0", "-r", "1",
            "-o", "json"]


def batched_bench_cmd(binary: Path, gguf: Path, threads: int, prompt_len: int, output_len: int,
                      parallel: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", "8192", "-b", "2048",
            "-ub", "512", "-npp", str(prompt_len), "-ntg", str(output_len),
            "-npl", str(parallel), "-kvu", "--output-format", "jsonl"]


def server_cmd(binary: Path, gguf: Path, threads: int, port: int, slots: int) -> list[str]:
    """Continuous batching over `slots` slots sharing one KV cache of 512 tokens per slot."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-c", str(512 * slots), "-np", str(slots), "-cb", "-kvu"]


def parse_llama_bench(stdout: str) -> dict[int, float]:
    """llama-bench -o json: prompt-processing tok/s by prompt length (its prefill-only tests)."""
    return {int(t["n_prompt"]): float(t["avg_ts"]) for t in json.loads(stdout) if int(t["n_gen"]) == 0}


def parse_batched_bench(stdout: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench --output-format jsonl: per parallel count, decode-only and aggregate tok/s."""
    rows = {}
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue  # the tool prints its table header and other lines around the JSON
        row = json.loads(line)
        generated = row["pl"] * row["tg"]
        rows[int(row["pl"])] = {"decode_tok_per_s": float(row["speed_tg"]),
                                "aggregate_tok_per_s": generated / float(row["t"])}
    return rows


def run_tool(cmd: list[str], timeout_s: float = 1800) -> str:
    """A tool's stdout; a failure names the tool and the end of its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        tail = "\n".join(proc.stderr.splitlines()[-10:])
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {proc.returncode}:\n{tail}")
    return proc.stdout
