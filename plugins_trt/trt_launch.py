"""What the TensorRT plugins (trt_plugin.py) launch, as arithmetic on shapes: no tensorrt import, so it is tested
on any machine with plain ints, and trt_plugin.py calls it with TensorRT's symbolic shape expressions (which
support the same + and //), resolved by TensorRT at each step's shapes.

One kernel per plugin node (a TensorRT AOT plugin embeds one): PagedKvWrite launches kv_write (one program per
token), PagedAttention the single-pass attention kernel with the mixed-batch tile plan. The split-context kernel
is not used under TensorRT: it needs a per-step choice (decode-only batch, few programs) and a third launch,
which a build-time kernel choice cannot make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.plugins_trt.aot import KernelShape, KernelSpec, attention_spec, kv_write_spec
from kiln.plugins_trt.plan import AttentionPlan, next_power_of_2

# TensorRT's DataType names (trt.DataType.X.name) of the pool types the kernels serve -> aot.POOL_TYPES keys
POOL_BY_TRT_TYPE = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "FP8": "fp8"}


@dataclass(frozen=True)
class Launch:
    """A kernel launch: its spec (compiled by aot.compile_spec), grid, and the int32 scalars TensorRT passes
    between the tensor inputs and outputs, in the kernel's parameter order."""

    spec: KernelSpec
    grid: tuple[Any, Any, Any]
    scalars: tuple[Any, ...]


def trt_attention_plan(num_heads: int, num_kv_heads: int) -> AttentionPlan:
    """The plan the PagedAttention plugin compiles: 64-row tiles of one sequence (mixed prefill/decode)."""
    group_pad = next_power_of_2(num_heads // num_kv_heads)
    return AttentionPlan(block_q=max(1, 64 // group_pad), group_pad=group_pad, tile=64)


def kv_write_launch(shape: KernelShape, num_tokens: Any, num_seqs: Any, num_blocks: Any, table_width: Any) -> Launch:
    """kv_write: grid (tokens,), scalars (num_seqs, num_blocks, block_table_stride)."""
    return Launch(kv_write_spec(shape), (num_tokens, 1, 1), (num_seqs, num_blocks, table_width))


def attention_launch(shape: KernelShape, num_tokens: Any, num_seqs: Any, table_width: Any) -> Launch:
    """Single-pass attention: grid (tokens // BLOCK_Q + seqs, KV heads, 1), scalars (num_seqs, stride)."""
    plan = trt_attention_plan(shape.num_heads, shape.num_kv_heads)
    grid = (num_tokens // plan.block_q + num_seqs, shape.num_kv_heads, 1)
    return Launch(attention_spec(shape, plan), grid, (num_seqs, table_width))
