"""A minimal driver for an engine graph (kiln/contract.py), for tests only.

Sequences get blocks from a bump allocator, and each step packs the new tokens of several
sequences into one batch for the runtime's OrtModelRunner; the pools (fp32, fp16 or int8) are
shaped as the graph's kv_cache.{i} inputs declare, so a bare optimized graph needs no manifest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.runtime.model_runner import Chunk, pack_chunks
from kiln.runtime.ort_runner import OrtModelRunner, graph_kv_pools, open_session


class PagedDriver:
    def __init__(self, model_path: Path, num_blocks: int = 256, threads: int = 2):
        session = open_session(model_path, threads)
        self.runner = OrtModelRunner(session, graph_kv_pools(session), num_blocks)
        self.next_block = 0
        self.lens: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}

    def step(self, chunks: list[tuple[int, list[int]]], all_rows: bool = False) -> np.ndarray:
        """Run new tokens of each (seq_id, token_ids); logits of each chunk's last row (or all rows)."""
        packed = []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            self.lens[seq] = start + len(tokens)
            table = self.blocks.setdefault(seq, [])
            while len(table) * self.runner.block_size < self.lens[seq]:
                assert self.next_block < self.runner.num_blocks, "driver pool exhausted"
                table.append(self.next_block)
                self.next_block += 1
            packed.append(Chunk(start, tokens, table))
        return self.runner.execute(pack_chunks(packed, all_rows))
