"""Measure onnxruntime-genai on run.py's shapes; runs inside the peers' own venv (no kiln import).

    ort-genai-venv/bin/python ort_genai_driver.py WORKLOAD.json   -> one JSON object on stdout

WORKLOAD.json: {"model": DIR, "threads": 2, "output_len": 128, "prefill_prompt": [ids],
"single_prompt": [ids], "batches": [[[ids], ...], ...]}. Every prompt is token ids, so all
systems see the very same tokens. Times: prefill = append_tokens of the whole prompt; decode rate
= (n - 1) tokens over the time from the first generated token to the last; aggregate = every
generated token over the whole run, prefill included. min_length keeps EOS from ending a row early.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import onnxruntime_genai as og


def load_model(folder: str, threads: int) -> og.Model:
    config = og.Config(folder)
    options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


def padded(prompts: list[list[int]], pad_id: int) -> np.ndarray:
    """Right padding, as the tokenizer's encode_batch lays a batch out."""
    width = max(len(p) for p in prompts)
    out = np.full((len(prompts), width), pad_id, dtype=np.int32)
    for row, prompt in enumerate(prompts):
        out[row, : len(prompt)] = prompt
    return out


def generate(model: og.Model, prompts: list[list[int]], output_len: int, pad_id: int) -> dict:
    """One batched greedy generation of exactly output_len tokens per row; its timings."""
    width = max(len(p) for p in prompts)
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=len(prompts), max_length=width + output_len,
                              min_length=width + output_len, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(padded(prompts, pad_id) if len(prompts) > 1 else np.asarray([prompts[0]], np.int32))
    prefilled = time.perf_counter()
    stamps = []
    for _ in range(output_len):
        generator.generate_next_token()
        stamps.append(time.perf_counter())
    tokens = len(prompts) * output_len
    return {
        "prefill_s": prefilled - start,
        "decode_tok_per_s": len(prompts) * (output_len - 1) / (stamps[-1] - stamps[0]),
        "aggregate_tok_per_s": tokens / (stamps[-1] - start),
    }


def main() -> None:
    work = json.loads(open(sys.argv[1]).read())
    model = load_model(work["model"], work["threads"])
    pad_id = json.loads(open(f"{work['model']}/genai_config.json").read())["model"]["pad_token_id"]
    out_len = work["output_len"]
    generate(model, [work["single_prompt"]], 8, pad_id)  # warm-up
    prefill = generate(model, [work["prefill_prompt"]], 2, pad_id)
    single = generate(model, [work["single_prompt"]], out_len, pad_id)
    result = {
        "prefill_tok_per_s": len(work["prefill_prompt"]) / prefill["prefill_s"],
        "decode_tok_per_s": single["decode_tok_per_s"],
        "batches": {},
    }
    for prompts in work["batches"]:
        run = generate(model, prompts, out_len, pad_id)
        result["batches"][str(len(prompts))] = {k: run[k] for k in ("aggregate_tok_per_s", "decode_tok_per_s")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
