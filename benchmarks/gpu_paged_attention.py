"""Decode attention bandwidth of the Triton paged-attention kernel against the GPU's copy bandwidth.

    python benchmarks/gpu_paged_attention.py [--heads 32 8 128] [--json OUT]

For batch 1/16/64 and contexts 1k/4k/16k (one decode token per sequence, blocks scattered through the pool)
and fp16, int8 and fp8 KV, it times kiln's attention step (KV write + attention [+ merge], as
launcher.paged_attention runs it with its own plan, metadata checks off) with CUDA events, and reports the
K/V bytes the step must read divided by its time, next to the device-to-device copy bandwidth measured
the same way (bytes read + written by a 1 GiB copy). The ratio is the figure of merit: decode attention is a
read of the whole context, so a kernel at 80% of copy bandwidth is close to what the memory allows. The step is
timed twice: launched from Python as the launcher runs it, and replayed from a CUDA graph of the same launches
(the GPU's own time, without the host's work between the kernels, as a TensorRT plan would launch them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from kiln.paged_attention import PagedAttentionAttrs
from kiln.plugins_trt.launcher import DeviceInputs, paged_attention
from kiln.plugins_trt.plan import plan_attention

BLOCK_SIZE = 16
KV_DTYPES = {"fp16": torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def time_ms(fn, repeats: int = 20) -> float:
    """Median milliseconds of fn() over repeats, after a warm-up call, timed with CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn) -> float | None:
    """Median milliseconds of replaying a CUDA graph captured from fn(); None where capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles and allocates outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        print(f"no CUDA graph: {error}")
        return None
    return time_ms(graph.replay)


def copy_bandwidth_gbs(size: int = 1 << 30) -> float:
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * size / time_ms(lambda: dst.copy_(src)) / 1e6


def decode_problem(batch: int, context: int, heads: tuple[int, int, int], kv: str):
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    dtype = KV_DTYPES[kv]
    pool = torch.empty(num_blocks, 2, num_kv_heads, BLOCK_SIZE, head_dim, device="cuda", dtype=torch.float16)
    pool.normal_()
    pool = (pool * 20).to(torch.int8) if kv == "int8" else pool.to(dtype)
    tables = torch.randperm(num_blocks - 1, device="cuda", dtype=torch.int32)[:batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).contiguous()
    inputs = DeviceInputs(
        query=torch.randn(batch, num_heads * head_dim, device="cuda"),
        key=torch.randn(batch, num_kv_heads * head_dim, device="cuda"),
        value=torch.randn(batch, num_kv_heads * head_dim, device="cuda"),
        kv_cache=pool, block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        kv_scale=None if kv == "fp16" else torch.full((2, num_kv_heads), 0.05, device="cuda"),
    )
    read = batch * context * 2 * num_kv_heads * head_dim * pool.element_size()
    return inputs, PagedAttentionAttrs(num_heads, num_kv_heads), read


def timed_row(inputs: DeviceInputs, attrs: PagedAttentionAttrs, plan, read: int, copy: float, **labels) -> dict:
    """One step timed launched and replayed from a CUDA graph, printed as a table row."""
    def step():
        return paged_attention(inputs, attrs, plan, check=False)

    ms, replay_ms = time_ms(step), graph_ms(step)
    gbs = read / ms / 1e6
    row = {**labels, "splits": plan.num_splits, "us": ms * 1e3, "gbs": gbs, "of_copy": gbs / copy,
           "graph_us": None, "graph_of_copy": None}
    graph_cells = "— | —"
    if replay_ms:
        row["graph_us"], row["graph_of_copy"] = replay_ms * 1e3, read / replay_ms / 1e6 / copy
        graph_cells = f"{row['graph_us']:.1f} | {row['graph_of_copy']:.0%}"
    print(f"| {labels['kv']} | {labels['batch']} | {labels['context']} | {plan.num_splits} | {ms * 1e3:.1f} | "
          f"{gbs:.0f} | {gbs / copy:.0%} | {graph_cells} |", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs=3, default=(32, 8, 128), metavar=("H", "HKV", "D"))
    parser.add_argument("--batches", type=int, nargs="+", default=(1, 16, 64))
    parser.add_argument("--contexts", type=int, nargs="+", default=(1024, 4096, 16384))
    parser.add_argument("--kv", nargs="+", default=list(KV_DTYPES), choices=list(KV_DTYPES))
    parser.add_argument("--splits", type=int, nargs="+",
                        help="time each step with these split counts instead of the plan's (a planning sweep)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name(0)}: device-to-device copy {copy:.0f} GB/s; heads {tuple(args.heads)}")
    print("| kv | batch | context | splits | time (us) | K/V read (GB/s) | of copy | graph (us) | of copy, graph |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for kv in args.kv:
        for batch in args.batches:
            for context in args.contexts:
                inputs, attrs, read = decode_problem(batch, context, tuple(args.heads), kv)
                group = attrs.num_heads // attrs.num_kv_heads
                planned = plan_attention(batch, batch, group, attrs.num_kv_heads, num_sms=sms, max_context=context)
                for plan in [dataclasses.replace(planned, num_splits=n) for n in args.splits or [planned.num_splits]]:
                    rows.append(timed_row(inputs, attrs, plan, read, copy, kv=kv, batch=batch, context=context))
                del inputs
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "copy_gbs": copy, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
