"""kiln's TensorRT plugins: the Triton kernels as TensorRT 10 Quickly Deployable Plugins with AOT implementations.

Importing this module registers two plugins with TensorRT (tensorrt.plugin, TensorRT >= 10.8 for aot_impl),
the ones optimize/lower_tensorrt.py's nodes name (op_type, plugin_namespace "kiln", aot = 1):

  kiln::PagedKvWrite    (key, value, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale, cos, sin)
                        -> kv_cache_out, aliased to kv_cache (the pool is written in place)
  kiln::PagedAttention  (query, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale, cos, sin) -> out

Each aot_impl compiles its Triton kernel to PTX for the GPU the plan is built on (aot.compile_spec), checks the
launch ABI (aot.check_trt_abi: inputs, int32 scalars, outputs; no Triton scratch), and returns the PTX with its
grid and int32 scalars as symbolic expressions of the input shapes (trt_launch.py), so the plan holds the
kernels and runs without Python. Attributes are baked into the PTX as constexprs: TensorRT does not serialize
an AOT plugin's attributes.

NOT RUN HERE: TensorRT cannot be installed on the machine this was written on (see docs/design.md, "TensorRT
backend"); it follows the tensorrt.plugin API of TensorRT 10.8+ and NVIDIA's quickly_deployable_plugins sample.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import KilnError

try:
    import tensorrt as trt
    import tensorrt.plugin as trtp
except ImportError as exc:  # one sentence, not a traceback into a missing package
    raise KilnError("kiln's TensorRT plugins need the tensorrt package (TensorRT 10.8 or newer, with "
                    "tensorrt.plugin.aot_impl) and a CUDA GPU, and tensorrt is not importable here") from exc

from kiln.plugins_trt.aot import KernelShape, check_trt_abi, compile_spec  # noqa: E402
from kiln.plugins_trt.trt_launch import POOL_BY_TRT_TYPE, Launch, attention_launch, kv_write_launch  # noqa: E402

KV_WRITE_ID = "kiln::PagedKvWrite"
ATTENTION_ID = "kiln::PagedAttention"
TYPE_NAMES = {"FLOAT": "FP32", "HALF": "FP16", "BF16": "BF16", "INT8": "INT8", "FP8": "FP8", "INT32": "INT32"}


def _constant(expr: Any, what: str) -> int:
    if not expr.is_constant:
        raise KilnError(f"the {what} must be a static dimension of the engine graph")
    return int(expr.constant_value)


def _kernel_shape(pool: Any, cos: Any, num_heads: int, num_kv_heads: int, scale: float,
                  sliding_window: int, rotary_interleaved: int) -> KernelShape:
    """The constexprs of both kernels, from the pool [N, 2, Hkv, block_size, D], cos [P, R/2] (or the one-element
    unused input: no RoPE in the op) and the node's attributes."""
    dims = pool.shape_expr
    half_rotary = _constant(cos.shape_expr[1], "rotary width") if cos.ndim == 2 else 0
    return KernelShape(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=_constant(dims[4], "head_dim"),
                       block_size=_constant(dims[3], "block size"), pool=POOL_BY_TRT_TYPE[pool.dtype.name],
                       half_rotary=half_rotary, interleaved=rotary_interleaved, sliding_window=sliding_window,
                       scale=scale)


def _aot(launch: Launch) -> tuple[bytes, bytes, Any, Any]:
    """(kernel name, PTX, launch params, int32 scalars) of a launch, compiled for this machine's GPU."""
    import triton

    target = triton.runtime.driver.active.get_current_target()
    compiled = compile_spec(launch.spec, target.arch)
    check_trt_abi(launch.spec, compiled)
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = launch.grid
    params.block_x = compiled.metadata.num_warps * 32
    params.shared_mem = compiled.metadata.shared
    scalars = trtp.SymIntExprs.from_tuple([trtp.SymInt32(value) for value in launch.scalars])
    return compiled.metadata.name.encode(), compiled.asm["ptx"].encode(), params, scalars


def _combination(descs: tuple[Any, ...]) -> list[Any]:
    """The one type combination a plugin runs with: its I/O types as the engine graph gives them."""
    return [trtp.AutoTuneCombination(", ".join(TYPE_NAMES[d.dtype.name] for d in descs), "LINEAR")]


@trtp.register(KV_WRITE_ID)
def kv_write_desc(key: trtp.TensorDesc, value: trtp.TensorDesc, kv_cache: trtp.TensorDesc,
                  block_tables: trtp.TensorDesc, seq_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc,
                  kv_scale: trtp.TensorDesc, cos_cache: trtp.TensorDesc, sin_cache: trtp.TensorDesc,
                  num_kv_heads: int, rotary_interleaved: int) -> trtp.TensorDesc:
    return kv_cache.aliased()


@trtp.autotune(KV_WRITE_ID)
def kv_write_autotune(key, value, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale, cos_cache,
                      sin_cache, outputs) -> list[trtp.AutoTuneCombination]:
    return _combination((key, value, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale, cos_cache,
                         sin_cache, *outputs))


@trtp.aot_impl(KV_WRITE_ID)
def kv_write_aot(key, value, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale, cos_cache, sin_cache,
                 num_kv_heads: int, rotary_interleaved: int, outputs, tactic):
    # num_heads and scale do not enter the KV write: any valid pair
    shape = _kernel_shape(kv_cache, cos_cache, num_kv_heads, num_kv_heads, 1.0, 0, rotary_interleaved)
    launch = kv_write_launch(shape, key.shape_expr[0], seq_lens.shape_expr[0], kv_cache.shape_expr[0],
                             block_tables.shape_expr[1])
    return _aot(launch)


@trtp.register(ATTENTION_ID)
def attention_desc(query: trtp.TensorDesc, kv_cache: trtp.TensorDesc, block_tables: trtp.TensorDesc,
                   seq_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc, kv_scale: trtp.TensorDesc,
                   cos_cache: trtp.TensorDesc, sin_cache: trtp.TensorDesc, num_kv_heads: int, rotary_interleaved: int,
                   num_heads: int, scale: float, sliding_window: int) -> trtp.TensorDesc:
    return trtp.from_shape_expr(query.shape_expr, dtype=trt.float32)


@trtp.autotune(ATTENTION_ID)
def attention_autotune(query, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale, cos_cache, sin_cache,
                       outputs) -> list[trtp.AutoTuneCombination]:
    return _combination((query, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale, cos_cache, sin_cache,
                         *outputs))


@trtp.aot_impl(ATTENTION_ID)
def attention_aot(query, kv_cache, block_tables, seq_lens, query_start_loc, kv_scale, cos_cache, sin_cache,
                  num_kv_heads: int, rotary_interleaved: int, num_heads: int, scale: float, sliding_window: int,
                  outputs, tactic):
    shape = _kernel_shape(kv_cache, cos_cache, num_heads, num_kv_heads, scale, sliding_window, rotary_interleaved)
    launch = attention_launch(shape, query.shape_expr[0], seq_lens.shape_expr[0], block_tables.shape_expr[1])
    return _aot(launch)
