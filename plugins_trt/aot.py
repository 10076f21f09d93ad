"""Ahead-of-time compilation of the kiln Triton kernels to PTX for an explicit GPU target, on any machine.

    python -m kiln.plugins_trt.aot -o DIR [--arch 80 --arch 90]

triton.compile with a GPUTarget needs no GPU and no CUDA driver (Triton ships LLVM's NVPTX back end and
ptxas), so the PTX the TensorRT plugin embeds (trt_plugin.py's aot_impl) is produced, and checked, on the
CPU build machine. DIR gets one .ptx per kernel and target and launch.json: each kernel's entry name, the
launch parameters a launcher needs (threads = num_warps * 32, dynamic shared memory, num_stages), and its
PTX parameters.

The launch ABI is TensorRT's for AOT plugins: the kernel's parameters are the plugin's tensor inputs, then its
int32 extra arguments, then its tensor outputs, and TensorRT fills the parameters it was not given with null.
Triton appends two of those (its global and profile scratch pointers); check_trt_abi refuses a kernel that
would need either (nonzero scratch size) or whose PTX parameters are not that layout.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kiln.plugins_trt.plan import AttentionPlan, next_power_of_2
from kiln.plugins_trt.triton_common import POOL_FLOAT, POOL_FP8, POOL_INT8

# Triton's pointer type names of the pool dtypes this path serves
POOL_TYPES = {"float32": ("*fp32", POOL_FLOAT), "float16": ("*fp16", POOL_FLOAT), "bfloat16": ("*bf16", POOL_FLOAT),
              "int8": ("*i8", POOL_INT8), "fp8": ("*fp8e4nv", POOL_FP8)}


@dataclass(frozen=True)
class KernelShape:
    """What a compiled kernel is specialized for: the model's attention geometry and the pool."""

    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    pool: str = "float16"  # a key of POOL_TYPES
    half_rotary: int = 32  # 0: RoPE outside the op
    interleaved: int = 0
    sliding_window: int = 0
    activation: str = "*fp32"  # query/key/value/out element type
    scale: float = 0.125  # the softmax scale (a constexpr: TensorRT passes int32 scalars only); 1/sqrt(64)

    def common(self) -> dict[str, int]:
        return {"HEAD_DIM": self.head_dim, "HEAD_DIM_PAD": max(16, next_power_of_2(self.head_dim)),
                "BLOCK_SIZE": self.block_size, "HALF_ROTARY": self.half_rotary, "INTERLEAVED": self.interleaved,
                "POOL_KIND": POOL_TYPES[self.pool][1]}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel specialization: its Triton signature (pointer/scalar types; constexprs by value)."""

    kernel: str  # "kv_write", "attention" or "merge"
    label: str  # the kernel and its tile constants, for file names
    signature: dict[str, str]  # the PTX parameters in order: tensor inputs, int32 scalars, tensor outputs
    constexprs: dict[str, int | float | bool | None] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2


def kv_write_spec(shape: KernelShape) -> KernelSpec:
    pool, act = POOL_TYPES[shape.pool][0], shape.activation
    signature = {"key_ptr": act, "value_ptr": act, "kv_cache_ptr": pool, "block_tables_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "kv_scale_ptr": "*fp32",
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32", "num_seqs": "i32", "num_blocks": "i32",
                 "block_table_stride": "i32", "kv_cache_out_ptr": pool}
    constexprs = {"NUM_KV_HEADS": shape.num_kv_heads, "KV_HEADS_PAD": next_power_of_2(shape.num_kv_heads),
                  **shape.common()}
    return KernelSpec("kv_write", "kv_write", signature, constexprs, num_warps=1, num_stages=1)


def attention_spec(shape: KernelShape, plan: AttentionPlan) -> KernelSpec:
    pool, act = POOL_TYPES[shape.pool][0], shape.activation
    signature = {"query_ptr": act, "kv_cache_ptr": pool, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "query_start_loc_ptr": "*i32", "kv_scale_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                 "num_seqs": "i32", "block_table_stride": "i32", "out_ptr": "*fp32"}
    splits: dict[str, int | float | bool | None] = {"partial_ptr": None, "stats_ptr": None}
    if plan.num_splits > 1:  # the partials are outputs too; the single pass has no such parameters at all
        signature |= {"partial_ptr": "*fp32", "stats_ptr": "*fp32"}
        splits = {}
    constexprs = {**splits, "SCALE": shape.scale, "NUM_HEADS": shape.num_heads, "NUM_KV_HEADS": shape.num_kv_heads,
                  "GROUP_PAD": plan.group_pad,
                  "BLOCK_Q": plan.block_q, "TILE": plan.tile, "SLIDING_WINDOW": shape.sliding_window,
                  "NUM_SPLITS": plan.num_splits, "INTERPRET": False, **shape.common()}
    label = f"attention_q{plan.block_q}_t{plan.tile}_s{plan.num_splits}"
    return KernelSpec("attention", label, signature, constexprs, plan.num_warps, plan.num_stages)


def merge_spec(shape: KernelShape, num_splits: int) -> KernelSpec:
    signature = {"partial_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*fp32"}
    constexprs = {"NUM_HEADS": shape.num_heads, "HEAD_DIM": shape.head_dim,
                  "HEAD_DIM_PAD": max(16, next_power_of_2(shape.head_dim)), "NUM_SPLITS": num_splits}
    return KernelSpec("merge", f"merge_s{num_splits}", signature, constexprs, num_warps=4, num_stages=1)


def kernel_function(kernel: str):
    from kiln.plugins_trt.attention import merge_splits_kernel, paged_attention_kernel
    from kiln.plugins_trt.kv_write import kv_write_kernel

    return {"kv_write": kv_write_kernel, "attention": paged_attention_kernel,
            "merge": merge_splits_kernel}[kernel]


def compile_spec(spec: KernelSpec, arch: int):
    """The triton CompiledKernel of spec for sm_{arch} (asm["ptx"], metadata.name/shared/num_warps)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_function(spec.kernel)
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("the kernels were loaded under TRITON_INTERPRET=1 and cannot be compiled; unset it")
    signature = {**spec.signature, **{name: "constexpr" for name in spec.constexprs}}
    source = ASTSource(fn=fn, signature=signature, constexprs=dict(spec.constexprs))
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def ptx_parameter_kinds(ptx: str, name: str) -> list[str]:
    """"ptr" or "i32" for each parameter of entry `name`, in order (what a launcher must pass)."""
    entry = re.search(rf"\.entry {re.escape(name)}\((.*?)\)", ptx, re.S)
    if entry is None:
        raise ValueError(f"the PTX has no entry {name}")
    kinds = []
    for param in re.findall(r"\.param\s+([^,]*?)\s+\w+(?:,|$)", entry.group(1).strip(), re.M):
        kinds.append("ptr" if ".ptr" in param else "i32" if param in (".u32", ".s32", ".b32") else param)
    return kinds


def signature_kinds(signature: dict[str, str]) -> list[str]:
    return ["ptr" if t.startswith("*") else t for t in signature.values()]


def is_trt_layout(kinds: list[str]) -> bool:
    """Whether parameters of these kinds are TensorRT's AOT order: pointers, int32 scalars, pointers."""
    return re.fullmatch(r"(ptr,)+(i32,)*(ptr,)+", "".join(f"{k}," for k in kinds)) is not None


def check_trt_abi(spec: KernelSpec, compiled) -> None:
    """Raise ValueError unless TensorRT's AOT launch (inputs, int32 scalars, outputs, null for the rest) runs
    the compiled kernel: its own parameters are pointers and i32s in that order, and Triton's two trailing
    scratch pointers, which TensorRT leaves null, are never used (zero scratch bytes)."""
    meta = compiled.metadata
    if meta.global_scratch_size or meta.profile_scratch_size:
        raise ValueError(f"{spec.label} needs Triton scratch memory (global {meta.global_scratch_size} B, profile "
                         f"{meta.profile_scratch_size} B), which a TensorRT AOT plugin cannot provide")
    kinds = signature_kinds(spec.signature)
    if not is_trt_layout(kinds):
        raise ValueError(f"{spec.label} parameters {kinds} are not tensor inputs, int32 scalars, tensor outputs")
    found = ptx_parameter_kinds(compiled.asm["ptx"], meta.name)
    if found != kinds + ["ptr", "ptr"]:
        raise ValueError(f"{spec.label} PTX parameters {found} are not its signature {kinds} and Triton's two "
                         "scratch pointers")


def launch_record(spec: KernelSpec, compiled, arch: int) -> dict:
    name = compiled.metadata.name
    kinds = ptx_parameter_kinds(compiled.asm["ptx"], name)
    return {"kernel": spec.label, "arch": f"sm_{arch}", "entry": name, "num_warps": compiled.metadata.num_warps,
            "threads": compiled.metadata.num_warps * 32, "num_stages": spec.num_stages,
            "shared_bytes": compiled.metadata.shared, "own_parameters": signature_kinds(spec.signature),
            "ptx_parameters": kinds, "constexprs": spec.constexprs,
            "global_scratch_bytes": compiled.metadata.global_scratch_size,
            "profile_scratch_bytes": compiled.metadata.profile_scratch_size}


def default_specs(shape: KernelShape) -> list[KernelSpec]:
    """What a SmolLM2-shaped engine launches: the KV write, the single-pass kernel at prefill and decode tile
    shapes, and the split-context kernel with its merge."""
    group_pad = next_power_of_2(shape.num_heads // shape.num_kv_heads)
    return [kv_write_spec(shape),
            attention_spec(shape, AttentionPlan(block_q=max(1, 64 // group_pad), group_pad=group_pad, tile=64)),
            attention_spec(shape, AttentionPlan(block_q=max(1, 16 // group_pad), group_pad=group_pad, tile=64)),
            attention_spec(shape, AttentionPlan(block_q=max(1, 16 // group_pad), group_pad=group_pad, tile=64,
                                                num_splits=8)),
            merge_spec(shape, 8)]


def compile_all(out_dir: Path, archs: tuple[int, ...] = (80, 90), shape: KernelShape = KernelShape()) -> list[dict]:
    """PTX of default_specs(shape) for each arch into out_dir, and out_dir/launch.json; returns its records."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for arch in archs:
        for spec in default_specs(shape):
            compiled = compile_spec(spec, arch)
            check_trt_abi(spec, compiled)
            (out_dir / f"{spec.label}.sm_{arch}.ptx").write_text(compiled.asm["ptx"])
            records.append(launch_record(spec, compiled, arch))
    (out_dir / "launch.json").write_text(json.dumps({"shape": shape.__dict__, "kernels": records}, indent=2))
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--arch", type=int, action="append", help="SM version (80, 90, ...); default 80 and 90")
    parser.add_argument("--pool", default="float16", choices=sorted(POOL_TYPES))
    args = parser.parse_args(argv)
    records = compile_all(args.out, tuple(args.arch or (80, 90)), KernelShape(pool=args.pool))
    for r in records:
        print(f"{r['arch']} {r['kernel']:<28} warps {r['num_warps']} stages {r['num_stages']} "
              f"shared {r['shared_bytes']} B")


if __name__ == "__main__":
    main()
