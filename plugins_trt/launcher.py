"""The Python launcher of the Triton kernels: kiln.PagedAttention on torch tensors (CUDA, or CPU under
TRITON_INTERPRET=1), with the reference's inputs and attributes.

    out = paged_attention(DeviceInputs.from_reference(inputs, device), attrs)   # kv_cache updated in place

Two launches (kv_write, then attention reading the updated pool), or three with split context (attention
partials, merge). The host-side checks here are the spec's "invalid inputs are errors": they read the small
metadata tensors (a device sync where they live on a GPU), so `check=False` skips them on a hot path whose
metadata the scheduler already guarantees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import numpy as np
import torch

from kiln.paged_attention import PagedAttentionAttrs, PagedAttentionInputs
from kiln.plugins_trt.attention import merge_splits_kernel, paged_attention_kernel
from kiln.plugins_trt.kv_write import kv_write_kernel
from kiln.plugins_trt.plan import AttentionPlan, next_power_of_2, plan_attention
from kiln.plugins_trt.triton_common import POOL_FLOAT, POOL_FP8, POOL_INT8

POOL_KINDS = {torch.float32: POOL_FLOAT, torch.float16: POOL_FLOAT, torch.bfloat16: POOL_FLOAT,
              torch.int8: POOL_INT8, torch.float8_e4m3fn: POOL_FP8}


@dataclass(frozen=True)
class DeviceInputs:
    """PagedAttentionInputs as torch tensors on one device; query/key/value float32, float16 or bfloat16,
    kv_cache float32/float16/bfloat16/int8/float8_e4m3fn (quantized pools need kv_scale [2, Hkv])."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_scale: torch.Tensor | None = None
    cos_cache: torch.Tensor | None = None
    sin_cache: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kv_cache.dtype not in POOL_KINDS:
            raise ValueError(f"kv_cache dtype {self.kv_cache.dtype} is not one of {list(POOL_KINDS)}")
        quantized = POOL_KINDS[self.kv_cache.dtype] != POOL_FLOAT
        if quantized != (self.kv_scale is not None):
            raise ValueError("kv_scale [2, num_kv_heads] is required with an int8 or fp8 kv_cache and only then")
        if (self.cos_cache is None) != (self.sin_cache is None):
            raise ValueError("cos_cache and sin_cache come together: RoPE needs both or neither")
        for f in fields(self):
            tensor = getattr(self, f.name)
            if tensor is not None and (tensor.device != self.query.device or not tensor.is_contiguous()):
                raise ValueError(f"{f.name} must be a contiguous tensor on {self.query.device}")

    @classmethod
    def from_reference(cls, inputs: PagedAttentionInputs, device: str | torch.device,
                       kv_dtype: torch.dtype | None = None) -> DeviceInputs:
        """The reference's numpy inputs copied to device (the pool cast to kv_dtype when given)."""
        def put(array: np.ndarray | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
            if array is None:
                return None
            tensor = torch.from_numpy(np.ascontiguousarray(array)).to(device)
            return tensor if dtype is None else tensor.to(dtype)

        if inputs.attend_until is not None:
            raise ValueError("attend_until (bidirectional image runs) is not supported by the Triton kernels")
        values = {f.name: put(getattr(inputs, f.name)) for f in fields(cls)}
        if kv_dtype is not None:
            values["kv_cache"] = put(inputs.kv_cache, kv_dtype)
        return cls(**values)


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), read at each launch as Triton does."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_inputs(inputs: DeviceInputs, attrs: PagedAttentionAttrs) -> None:
    """Every input the kernels would misread, named in one sentence (reads the metadata on the host)."""
    if attrs.softcap:
        raise ValueError("the Triton kernels do not implement the attention logit soft-cap (softcap > 0)")
    num_blocks, two, num_kv_heads, block_size, head_dim = inputs.kv_cache.shape
    if two != 2 or num_kv_heads != attrs.num_kv_heads:
        raise ValueError(f"kv_cache {tuple(inputs.kv_cache.shape)} is not [num_blocks, 2, {attrs.num_kv_heads}, "
                         "block_size, head_dim]")
    T = inputs.query.shape[0]
    for name, width in (("query", attrs.num_heads * head_dim), ("key", num_kv_heads * head_dim),
                        ("value", num_kv_heads * head_dim)):
        if tuple(getattr(inputs, name).shape) != (T, width):
            raise ValueError(f"{name} must be [{T}, {width}], got {tuple(getattr(inputs, name).shape)}")
    qsl = inputs.query_start_loc.cpu().numpy().astype(np.int64)
    seq_lens = inputs.seq_lens.cpu().numpy().astype(np.int64)
    tables = inputs.block_tables.cpu().numpy()
    S = len(seq_lens)
    if qsl.shape != (S + 1,) or qsl[0] != 0 or qsl[-1] != T or (np.diff(qsl) < 0).any():
        raise ValueError(f"query_start_loc must rise from 0 to num_tokens {T} over {S + 1} entries")
    q_lens = np.diff(qsl)
    if (seq_lens < q_lens).any():
        raise ValueError("every seq_lens entry must be at least its sequence's number of new tokens")
    needed = -(-seq_lens // block_size)
    if tables.ndim != 2 or tables.shape[0] != S or (S and needed.max() > tables.shape[1]):
        raise ValueError(f"block_tables must be [{S}, >= {int(needed.max()) if S else 0}] for these seq_lens")
    for s in range(S):
        window = attrs.sliding_window
        first = 0 if not window else max(0, (int(seq_lens[s]) - int(q_lens[s]) - window + 1) // block_size)
        used = tables[s, first:needed[s]] if q_lens[s] else tables[s, :0]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            raise ValueError(f"block_tables row {s} names a block outside the pool of {num_blocks} blocks")
    if inputs.cos_cache is not None and T and int(seq_lens.max()) > inputs.cos_cache.shape[0]:
        raise ValueError(f"position {int(seq_lens.max()) - 1} is past the cos/sin cache "
                         f"({inputs.cos_cache.shape[0]} positions)")


def paged_attention(inputs: DeviceInputs, attrs: PagedAttentionAttrs, plan: AttentionPlan | None = None,
                    check: bool = True) -> torch.Tensor:
    """out [T, H*D] (float32); the new tokens' K/V are written into inputs.kv_cache in place."""
    if check:
        check_inputs(inputs, attrs)
    pool = inputs.kv_cache
    _, _, num_kv_heads, block_size, head_dim = pool.shape
    T, S = inputs.query.shape[0], inputs.seq_lens.shape[0]
    group = attrs.num_heads // attrs.num_kv_heads
    plan = plan or plan_attention(T, S, group, num_kv_heads)
    if plan.group_pad < group:
        raise ValueError(f"plan.group_pad {plan.group_pad} is below the {group} query heads per KV head")
    out = torch.empty(T, attrs.num_heads * head_dim, dtype=torch.float32, device=pool.device)
    if T == 0:
        return out
    kind = POOL_KINDS[pool.dtype]
    no_tensor = torch.zeros(1, dtype=torch.float32, device=pool.device)
    scale_t = inputs.kv_scale if inputs.kv_scale is not None else no_tensor
    cos = inputs.cos_cache if inputs.cos_cache is not None else no_tensor
    sin = inputs.sin_cache if inputs.sin_cache is not None else no_tensor
    half_rotary = 0 if inputs.cos_cache is None else inputs.cos_cache.shape[1]
    shape = {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": max(16, next_power_of_2(head_dim)), "BLOCK_SIZE": block_size,
             "HALF_ROTARY": half_rotary, "INTERLEAVED": attrs.rotary_interleaved, "POOL_KIND": kind}
    kv_write_kernel[(T,)](
        inputs.key, inputs.value, pool, inputs.block_tables, inputs.seq_lens, inputs.query_start_loc, scale_t,
        cos, sin, S, pool.shape[0], inputs.block_tables.stride(0), pool,
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=next_power_of_2(num_kv_heads), **shape,
    )
    splits = plan.num_splits
    partial = stats = no_tensor
    if splits > 1:
        partial = torch.empty(T, attrs.num_heads, splits, head_dim, dtype=torch.float32, device=pool.device)
        stats = torch.empty(T, attrs.num_heads, splits, 2, dtype=torch.float32, device=pool.device)
    scale = attrs.scale or 1.0 / float(np.sqrt(head_dim))
    paged_attention_kernel[plan.grid(T, S, num_kv_heads)](
        inputs.query, pool, inputs.block_tables, inputs.seq_lens, inputs.query_start_loc, scale_t, cos, sin,
        S, inputs.block_tables.stride(0), out, partial, stats,
        SCALE=scale, NUM_HEADS=attrs.num_heads, NUM_KV_HEADS=num_kv_heads, GROUP_PAD=plan.group_pad,
        BLOCK_Q=plan.block_q, TILE=plan.tile, SLIDING_WINDOW=attrs.sliding_window, NUM_SPLITS=splits,
        INTERPRET=interpreted(),
        num_warps=plan.num_warps, num_stages=plan.num_stages, **shape,
    )
    if splits > 1:
        merge_splits_kernel[(T, attrs.num_heads)](
            partial, stats, out, NUM_HEADS=attrs.num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=shape["HEAD_DIM_PAD"],
            NUM_SPLITS=splits,
        )
    return out


__all__ = ["DeviceInputs", "paged_attention", "check_inputs", "AttentionPlan", "plan_attention"]
