"""Launch planning for the attention kernel: tile shapes and the split-context decision, from shapes alone.

Like FlashInfer's planner, the decision is made on the host before the launch, but from what is known
without reading device memory (the TensorRT plugin sees shapes only): the number of tokens and sequences,
the KV heads and, when the caller knows it, the longest context. A batch that is all decode (one token per
sequence) and puts fewer than two programs per SM on the GPU splits each context into ranges (flash-decoding)
until there are about PROGRAMS_PER_SM programs per SM, up to MAX_SPLITS; everything else runs the single-pass
kernel. The constants come from a sweep on an H200 (benchmarks/gpu_paged_attention.py --splits, replayed from a
CUDA graph): a single 16k-64k sequence read K/V fastest at 64 splits (512 programs), 4 sequences at 16, 16 at 4,
and 64 sequences unsplit.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # what a split decode batch aims for: enough loads in flight per SM to stream K/V
MIN_TILES_PER_SPLIT = 2  # a split that reads fewer K/V tiles than this costs more in the merge than it saves


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def power_of_2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


@dataclass(frozen=True)
class AttentionPlan:
    """How one kiln.PagedAttention call is launched (all compile-time constants of the kernels)."""

    block_q: int  # query tokens per program; block_q * group_pad rows (>= 16: the dot's minimum)
    group_pad: int  # query heads per KV head, rounded up to a power of two
    tile: int  # K/V positions per loop step
    num_splits: int = 1  # > 1: split-context kernel + merge
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "group_pad", "tile", "num_splits", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"AttentionPlan.{name} must be a power of two >= 1, got {value}")
        if self.block_q * self.group_pad < 16 or self.tile < 16:
            raise ValueError(f"block_q * group_pad ({self.block_q * self.group_pad}) and tile ({self.tile}) must "
                             f"be >= 16, the smallest tl.dot")

    @property
    def block_m(self) -> int:
        return self.block_q * self.group_pad

    def grid(self, num_tokens: int, num_seqs: int, num_kv_heads: int) -> tuple[int, int, int]:
        """Programs: every query block of every sequence (see attention.py) x KV heads x splits."""
        return (num_tokens // self.block_q + num_seqs, num_kv_heads, self.num_splits)


def plan_attention(num_tokens: int, num_seqs: int, group: int, num_kv_heads: int, *,
                   num_sms: int = 132, max_context: int | None = None) -> AttentionPlan:
    """The plan for a batch of these shapes on a GPU with num_sms SMs (132: H100/H200)."""
    group_pad = next_power_of_2(group)
    block_m = max(16, group_pad) if num_tokens == num_seqs else max(64, group_pad)
    block_q = max(1, block_m // group_pad)
    tile = 64
    splits = 1
    programs = num_seqs * num_kv_heads
    if num_tokens == num_seqs and programs < 2 * num_sms:
        splits = min(MAX_SPLITS, power_of_2_at_most(PROGRAMS_PER_SM * num_sms // programs))
        if max_context is not None:
            splits = min(splits, next_power_of_2(max(1, -(-max_context // (tile * MIN_TILES_PER_SPLIT)))))
    return AttentionPlan(block_q=block_q, group_pad=group_pad, tile=tile, num_splits=splits)
