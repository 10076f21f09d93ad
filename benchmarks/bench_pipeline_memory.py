"""A 2-stage pipeline serving a model whose one-graph engine does not fit the memory one stage is given.

With a cap of BUDGET MiB on what a process may add to its private memory (RLIMIT_DATA, enforced by the kernel:
kiln.runtime.pipeline.memory), each in a fresh process: the one graph's load, uncapped (what it needs) and
capped (it fails), and each stage's load, capped. Then the 2-stage deployment, `--pipeline-parallel 2
--stage-memory-bytes BUDGET` (each stage in a Ray actor under the cap), generates greedy tokens, compared with
the one graph's in this process, uncapped; each stage's resident memory its load added is read from the
engine's stats (kiln_pipeline_stage_resident_bytes). Last, the last stage's process is SIGKILLed under a running
request: the seconds until that request has failed (the runner started the stage again, reloading its graph
under the cap) and a new request's tokens, which must again be the one graph's.

    python benchmarks/bench_pipeline_memory.py ENGINE_DIR --budget-mib 450     (ENGINE_DIR: a one-graph engine)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kiln.optimize.split_stages import split_engine
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig, SamplingParams

PROMPT = [1, 504, 3456, 314, 260, 1789, 282, 4210, 28, 1838, 314, 260]  # a fixed prompt (token ids)
NEW_TOKENS = 16


def probe(graph: Path, budget_bytes: int | None) -> dict[str, Any]:
    """kiln.runtime.pipeline.memory's probe in a fresh process: does graph load under the cap."""
    command = [sys.executable, "-m", "kiln.runtime.pipeline.memory", str(graph)]
    if budget_bytes is not None:
        command += ["--budget-bytes", str(budget_bytes)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"the probe of {graph} printed nothing: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def generate(engine: Engine, request_id: str) -> tuple[list[int], str | None]:
    """NEW_TOKENS greedy tokens of PROMPT, and the request's error (None: it finished)."""
    engine.add_request(request_id, PROMPT, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    tokens: list[int] = []
    error = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
            error = error or out.error
    return tokens, error


def kill_and_recover(engine: Engine) -> dict[str, Any]:
    """SIGKILL the last stage's actor after a request's first token; seconds until that request has failed,
    and the tokens of a request sent after it."""
    chain: Any = engine.runner.chain  # type: ignore[attr-defined]
    engine.add_request("cut", PROMPT, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    generated = engine.stats().num_generated_tokens
    while engine.stats().num_generated_tokens == generated:
        engine.step()
    victim = chain.pids[-1]
    os.kill(victim, signal.SIGKILL)
    start, error = time.perf_counter(), None
    while engine.has_unfinished():
        for out in engine.step():
            error = error or out.error
    failed_after = time.perf_counter() - start
    tokens, after_error = generate(engine, "after")
    return {"killed_pid": victim, "restarted_pid": chain.pids[-1], "cut_request_error": error,
            "seconds_to_fail_and_restart": round(failed_after, 2), "after": tokens, "after_error": after_error}


def greedy(engine_dir: Path, config: RuntimeConfig, kill: bool = False) -> dict[str, Any]:
    """NEW_TOKENS greedy tokens of PROMPT and each stage's resident memory its load added (empty: one graph);
    with kill, kill_and_recover's figures."""
    engine = load_engine(engine_dir, config)
    try:
        tokens, _ = generate(engine, "0")
        result = {"tokens": tokens, "stage_resident": engine.stats().pipeline.stage_resident_bytes}
        if kill:
            result.update(kill_and_recover(engine))
        return result
    finally:
        engine.runner.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--budget-mib", type=int, default=450)
    args = parser.parse_args()
    budget = args.budget_mib << 20
    base = dict(num_threads=1, kv_cache_bytes=16 << 20, max_model_len=256)
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "staged"
        split_engine(args.engine, staged, 2)
        probes = [probe(args.engine / "model.onnx", None), probe(args.engine / "model.onnx", budget),
                  probe(staged / "stage0.onnx", budget), probe(staged / "stage1.onnx", budget)]
        for result in probes:
            print(json.dumps(result), flush=True)
        want = greedy(args.engine, RuntimeConfig(**base))["tokens"]  # type: ignore[arg-type]
        import ray

        try:
            got = greedy(staged, RuntimeConfig(**base, pipeline_parallel=2,  # type: ignore[arg-type]
                                               stage_memory_bytes=budget), kill=True)
        finally:
            ray.shutdown()
        stage_weights = [(staged / f"stage{k}.onnx.data").stat().st_size for k in range(2)]
    deployment = {"deployment": "2 Ray actors, --stage-memory-bytes", "budget_mib": args.budget_mib,
                  "generated": len(got["tokens"]), "tokens_match_one_graph": got["tokens"] == want,
                  "stage_resident_mib": [round(r / 2**20, 1) for r in got["stage_resident"]],
                  "stage_weights_mib": [round(size / 2**20, 1) for size in stage_weights],
                  "one_graph_weights_mib": round((args.engine / "model.onnx.data").stat().st_size / 2**20, 1)}
    print(json.dumps(deployment), flush=True)
    recovery = {"killed_pid": got["killed_pid"], "restarted_pid": got["restarted_pid"],
                "cut_request_error": got["cut_request_error"],
                "seconds_to_fail_and_restart": got["seconds_to_fail_and_restart"],
                "after_restart_tokens_match_one_graph": got["after"] == want and got["after_error"] is None}
    print(json.dumps(recovery), flush=True)
    whole_uncapped, whole_capped, *stages = probes
    ok = not whole_capped["loaded"] and all(s["loaded"] for s in stages) and deployment["tokens_match_one_graph"] \
        and recovery["after_restart_tokens_match_one_graph"] and recovery["cut_request_error"] is not None
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
