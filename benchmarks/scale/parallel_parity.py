"""Pipeline stages and tensor-parallel ranks against the one graph at a real model shape (random weights).

    python benchmarks/scale/parallel_parity.py [--shape llama-3.2-1b] [--work DIR] [--keep]

Writes the shape's random fp32 checkpoint (SmolLM2's tokenizer), builds its fp32 engine, splits it into 2 and 3
pipeline stages and 2 tensor-parallel ranks, and runs the checks tests/golden/test_pipeline_smollm2.py and
test_tensor_parallel_smollm2.py run on SmolLM2: greedy tokens of 8 prompts arriving one per step under a pool small
enough to preempt, with prefix caching (one thread per stage / rank), must equal the one graph's; the logits of one
packed prefill and one decode step must be within 1e-4. One JSON line per layout; exit status 1 if any differs.
The drivers are the tests' own (tests/pipeline_helpers.py), so the checks are the same ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the tests' drivers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import SHAPES, write_checkpoint, write_smollm2_tokenizer  # noqa: E402
from pipeline_helpers import staggered_greedy, step_logits  # noqa: E402

from kiln.manifest import BuildOptions, read_manifest  # noqa: E402
from kiln.optimize.build import build_engine  # noqa: E402
from kiln.optimize.shard_tensor_parallel import split_engine_tensor_parallel  # noqa: E402
from kiln.optimize.split_stages import split_engine  # noqa: E402
from kiln.runtime.params import RuntimeConfig  # noqa: E402
from kiln.runtime.tokenizer import Tokenizer  # noqa: E402

SYSTEM = "You are a careful assistant. Answer in one short paragraph, and say when you do not know. "
QUESTIONS = ["What is a paged KV cache?", "Why is the sky blue?", "Name three prime numbers.", "What is JSON?",
             "How do bees make honey?", "What is a compiler?", "Explain recursion.", "What is 17 times 3?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-parallel-parity"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and engines (GBs) afterwards")
    args = parser.parse_args()
    work, shape = args.work, SHAPES[args.shape]
    shutil.rmtree(work, ignore_errors=True)
    started = time.perf_counter()
    hf = work / "hf"
    write_checkpoint(shape, hf)
    write_smollm2_tokenizer(hf)
    one = work / "one"
    build_engine(hf, one, BuildOptions(kv_dtype="float32"), progress=lambda msg: print(msg, flush=True))
    shutil.rmtree(hf)  # the engine holds the weights now
    layouts = {"2 stages": work / "s2", "3 stages": work / "s3", "2 ranks": work / "t2"}
    split_engine(one, layouts["2 stages"], 2)
    split_engine(one, layouts["3 stages"], 3)
    split_engine_tensor_parallel(one, layouts["2 ranks"], 2)
    print(json.dumps({"shape": args.shape, "prepared_s": round(time.perf_counter() - started, 1)}), flush=True)

    spec = read_manifest(one).spec
    tokenizer = Tokenizer(one)
    prompts = [tokenizer.encode(SYSTEM + question) for question in QUESTIONS]
    block_bytes = spec.num_layers * 2 * spec.num_kv_heads * 16 * spec.head_dim * 4  # float32 KV
    config = RuntimeConfig(num_threads=1, kv_cache_bytes=14 * block_bytes, max_model_len=160)
    want, _ = staggered_greedy(one, prompts, config)
    want_prefill, want_decode = step_logits(one, prompts[:3])
    failed = False
    for name, engine in layouts.items():
        started = time.perf_counter()
        micro = 2 if "stages" in name else None
        got, stats = staggered_greedy(engine, prompts, dataclasses.replace(config, pipeline_micro_batches=micro))
        prefill, decode = step_logits(engine, prompts[:3], micro)
        error = float(max(abs(prefill - want_prefill).max(), abs(decode - want_decode).max()))
        same = got == want
        failed |= not same or error > 1e-4
        seconds = round(time.perf_counter() - started, 1)
        scale = float(max(abs(want_prefill).max(), abs(want_decode).max()))  # the largest logit, for scale
        print(json.dumps({"layout": name, "micro_batches": micro, "tokens_identical": same, "max_logit_error": error,
                          "max_abs_logit": scale, "preemptions": stats.num_preemptions,
                          "prefix_cache_hits": stats.prefix_cache_hits, "seconds": seconds}), flush=True)
    if not args.keep:
        shutil.rmtree(work)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
