"""Random kiln.PagedAttention problems for testing the Triton kernels against the reference (CPU interpreter
tests, GPU tests and the benchmark share them): ragged batches mixing prefill chunks, decode tokens and empty
sequences over shuffled block tables in a pool larger than what they use."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.paged_attention import PagedAttentionAttrs, PagedAttentionInputs, token_positions


@dataclass(frozen=True)
class Case:
    """One problem: the sequences' new tokens and cached contexts, the pool's geometry and the op's attributes."""

    q_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # tokens already in the pool before this step
    block_size: int = 16
    spare_blocks: int = 5  # pool blocks no sequence uses
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    sliding_window: int = 0
    rotary: int = -1  # -1: no RoPE in the op; 0: rotate_half; 1: interleaved pairs
    int8: bool = False  # an int8 pool with per-head steps (else float32; the device pool dtype is chosen apart)

    @property
    def attrs(self) -> PagedAttentionAttrs:
        return PagedAttentionAttrs(self.num_heads, self.num_kv_heads, sliding_window=self.sliding_window,
                                   rotary_interleaved=max(self.rotary, 0))


def make_inputs(case: Case, seed: int = 0) -> PagedAttentionInputs:
    """The reference's inputs for case: block tables are a shuffled draw from the pool, padded with -1."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array([c + q for c, q in zip(case.context_lens, case.q_lens, strict=True)], np.int32)
    qsl = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    blocks_needed = [-(-int(n) // case.block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + case.spare_blocks
    order = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(seq_lens), max(blocks_needed + [1]) + 1), -1, np.int32)
    used = 0
    for s, n in enumerate(blocks_needed):
        tables[s, :n] = order[used:used + n]
        used += n
    T, D = int(qsl[-1]), case.head_dim
    shape = (num_blocks, 2, case.num_kv_heads, case.block_size, D)
    kv_scale = None
    if case.int8:
        pool = rng.integers(-127, 128, shape, dtype=np.int8)
        kv_scale = rng.uniform(0.01, 0.03, (2, case.num_kv_heads)).astype(np.float32)
    else:
        pool = rng.standard_normal(shape).astype(np.float32)
    cos = sin = None
    if case.rotary >= 0:
        angles = np.arange(int(seq_lens.max()) + 3)[:, None] * (1e-2 * 10000 ** (-np.arange(D // 2) / (D // 2)))
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    def normal(width: int) -> np.ndarray:
        return rng.standard_normal((T, width)).astype(np.float32)

    return PagedAttentionInputs(normal(case.num_heads * D), normal(case.num_kv_heads * D),
                                normal(case.num_kv_heads * D), pool, tables, seq_lens, qsl, kv_scale, cos, sin)


def new_slots(inputs: PagedAttentionInputs) -> tuple[np.ndarray, np.ndarray]:
    """(block, slot) of every new token: where the KV write lands."""
    positions = token_positions(inputs.seq_lens, inputs.query_start_loc)
    seq_of_token = np.repeat(np.arange(len(inputs.seq_lens)), np.diff(inputs.query_start_loc))
    block_size = inputs.kv_cache.shape[3]
    return inputs.block_tables[seq_of_token, positions // block_size], positions % block_size
