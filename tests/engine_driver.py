"""A minimal numpy driver for an engine graph (kiln/contract.py), for tests only.

Sequences get blocks from a bump allocator; each step packs the new tokens of several
sequences, binds every layer's pool to both kv_cache.{i} and kv_cache_out.{i} (one OrtValue,
written in place), and returns the logits rows asked for. The real runtime is kiln.runtime.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from kiln import contract


def make_session(model_path, threads: int = 2) -> ort.InferenceSession:
    from kiln.runtime.ops import library_path

    options = ort.SessionOptions()
    options.register_custom_ops_library(library_path())
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


class PagedDriver:
    def __init__(self, session: ort.InferenceSession, num_blocks: int = 256):
        self.session = session
        pools = [i for i in session.get_inputs() if i.name.startswith("kv_cache.")]
        _, _, kv_heads, self.block_size, head_dim = pools[0].shape
        dtype = np.float16 if pools[0].type == "tensor(float16)" else np.float32
        shape = contract.kv_pool_shape(num_blocks, kv_heads, self.block_size, head_dim)
        self.pools = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype)) for _ in pools]
        self.num_blocks = num_blocks
        self.next_block = 0
        self.lens: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}

    def step(self, chunks: list[tuple[int, list[int]]], all_rows: bool = False) -> np.ndarray:
        """Run new tokens of each (seq_id, token_ids); logits of each chunk's last row (or all rows)."""
        ids, pos, qsl, lens, rows = [], [], [0], [], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.blocks.setdefault(seq, [])
            while len(table) * self.block_size < end:
                assert self.next_block < self.num_blocks, "driver pool exhausted"
                table.append(self.next_block)
                self.next_block += 1
            self.lens[seq] = end
            ids += tokens
            pos += range(start, end)
            rows += range(qsl[-1], qsl[-1] + len(tokens)) if all_rows else [qsl[-1] + len(tokens) - 1]
            qsl.append(qsl[-1] + len(tokens))
            lens.append(end)
        width = max(len(self.blocks[seq]) for seq, _ in chunks)
        tables = np.zeros((len(chunks), width), np.int32)
        for row, (seq, _) in enumerate(chunks):
            tables[row, : len(self.blocks[seq])] = self.blocks[seq]
        feeds = {
            contract.INPUT_IDS: np.array(ids, np.int64),
            contract.POSITION_IDS: np.array(pos, np.int64),
            contract.QUERY_START_LOC: np.array(qsl, np.int32),
            contract.SEQ_LENS: np.array(lens, np.int32),
            contract.BLOCK_TABLES: tables,
            contract.LOGITS_INDICES: np.array(rows, np.int64),
        }
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        binding.bind_output(contract.LOGITS)  # first: copy_outputs_to_cpu() follows binding order
        for layer, pool in enumerate(self.pools):
            binding.bind_ortvalue_input(contract.kv_cache_input(layer), pool)
            binding.bind_ortvalue_output(contract.kv_cache_output(layer), pool)
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]
