"""A minimal driver for an engine graph (kiln/contract.py), for tests only.

Sequences get blocks from a bump allocator, and each step packs the new tokens of several
sequences into one batch for the runtime's OrtModelRunner; the pools (fp32, fp16 or int8) are
shaped as the graph's kv_cache.{i} inputs declare, so a bare optimized graph needs no manifest.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from kiln.runtime.model_runner import Chunk, RunnerOutput, pack_chunks
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
        return self.runner.execute(self._pack(chunks, all_rows))

    def step_medusa(self, chunks: list[tuple[int, list[int]]], all_rows: bool = False,
                    medusa_rows: list[int] | None = None) -> RunnerOutput:
        """step(), also asking for the Medusa heads' logits at medusa_rows (rows of the packed batch;
        default: the rows that get logits)."""
        batch = self._pack(chunks, all_rows)
        rows = batch.logits_indices if medusa_rows is None else np.array(medusa_rows, dtype=np.int64)
        return self.runner.execute_all(dataclasses.replace(batch, medusa_indices=rows))

    def _pack(self, chunks: list[tuple[int, list[int]]], all_rows: bool):
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
        return pack_chunks(packed, all_rows)
