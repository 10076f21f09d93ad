"""Measure OpenVINO GenAI on peers.py's workload; runs inside its own venv (no kiln import).

    openvino-venv/bin/python openvino_driver.py WORKLOAD.json   -> one JSON object on stdout

WORKLOAD.json is ort_genai_driver.py's: {"model": DIR, "threads": 2, "output_len": 128, "prefill_prompt": [ids],
"single_prompt": [ids], "batches": [[[ids], ...], ...]}, plus an optional "precision" (the CPU plugin's
INFERENCE_PRECISION_HINT, e.g. "f32"; its default is bf16 on a CPU with AVX-512 BF16 or AMX). LLMPipeline runs
paged attention with continuous batching (the SchedulerConfig below); a batch of token-id rows is one request a
row. Times come from the pipeline's own perf metrics: prefill = prompt tokens over the time to the first token,
decode = 1 / mean time per output token; aggregate = every generated token over the wall time of the whole
generate call, prefill included.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


def pipeline(folder: str, threads: int, precision: str | None) -> ov_genai.LLMPipeline:
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = 2  # GB of KV blocks: a 4k-token sequence or 16 of 256 tokens fit
    scheduler.max_num_batched_tokens = 2048
    hints = {"INFERENCE_PRECISION_HINT": precision} if precision else {}  # default: bf16 where the CPU has it
    return ov_genai.LLMPipeline(folder, "CPU", scheduler_config=scheduler, INFERENCE_NUM_THREADS=threads, **hints)


def generate(pipe: ov_genai.LLMPipeline, prompts: list[list[int]], output_len: int) -> dict:
    config = ov_genai.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, ignore_eos=True,
                                       do_sample=False, apply_chat_template=False)
    ids = np.asarray(prompts, dtype=np.int64)  # rows of equal length: no padding
    inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
    start = time.perf_counter()
    result = pipe.generate(inputs, config)
    wall = time.perf_counter() - start
    metrics = result.perf_metrics
    return {"ttft_s": metrics.get_ttft().mean / 1000, "tpot_s": metrics.get_tpot().mean / 1000,
            "aggregate_tok_per_s": len(prompts) * output_len / wall}


def main() -> None:
    work = json.loads(open(sys.argv[1]).read())
    pipe = pipeline(work["model"], work["threads"], work.get("precision"))
    out_len = work["output_len"]
    generate(pipe, [work["single_prompt"]], 8)  # warm-up
    prefill = generate(pipe, [work["prefill_prompt"]], 1)
    single = generate(pipe, [work["single_prompt"]], out_len)
    result = {"prefill_tok_per_s": len(work["prefill_prompt"]) / prefill["ttft_s"],
              "decode_tok_per_s": 1 / single["tpot_s"], "batches": {},
              "inference_precision": work.get("precision")
              or str(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))}
    for prompts in work["batches"]:
        run = generate(pipe, prompts, out_len)
        result["batches"][str(len(prompts))] = {"aggregate_tok_per_s": run["aggregate_tok_per_s"],
                                                "decode_tok_per_s": len(prompts) / run["tpot_s"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
