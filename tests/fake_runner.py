"""A deterministic stand-in model for tests of the policy core (no ONNX, no weights).

Its "KV pool" stores token ids: a step writes each new token into its slot through the
block table, exactly as kiln.PagedAttention writes K/V, and the logits of a row are a
function of the whole context read back through the block table. A scheduler or block
manager bug that loses, overwrites or misplaces cached tokens therefore changes the output.
With a sliding window a row reads only the last `sliding_window` positions, as kiln.PagedAttention does, and
a block-table entry it reads must name a block (a block released too early fails loudly).
"""

from __future__ import annotations

import numpy as np

from kiln.runtime.kv_transfer import KvLayout
from kiln.runtime.model_runner import BatchInput, ModelRunner


class FakeModelRunner(ModelRunner):
    def __init__(self, num_blocks: int, block_size: int = 4, vocab_size: int = 64, sliding_window: int = 0) -> None:
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.pool = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.steps: list[BatchInput] = []

    def execute(self, batch: BatchInput) -> np.ndarray:
        self.steps.append(batch)
        bs = self.block_size
        qsl, lens, tables = batch.query_start_loc, batch.seq_lens, batch.block_tables
        row_of_token = np.repeat(np.arange(len(lens)), np.diff(qsl))
        for t in range(batch.num_tokens):
            s, pos = row_of_token[t], int(batch.position_ids[t])
            assert pos == lens[s] - (qsl[s + 1] - t), (pos, lens[s], qsl[s + 1], t)
            self.pool[tables[s, pos // bs], pos % bs] = batch.input_ids[t]
        logits = np.empty((len(batch.logits_indices), self.vocab_size), dtype=np.float32)
        for r, t in enumerate(batch.logits_indices.tolist()):
            logits[r] = self.logits_for(self.context(batch, t))
        return logits

    def kv_layout(self) -> KvLayout:
        return KvLayout(1, (self.block_size,), self.pool.dtype)

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        return self.pool[np.asarray(block_ids, dtype=np.int64)][None]

    def write_kv_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        self.pool[np.asarray(block_ids, dtype=np.int64)] = blocks[0]

    def context(self, batch: BatchInput, t: int) -> np.ndarray:
        """The tokens packed token t attends to (itself included), read back through its block table."""
        bs, qsl = self.block_size, batch.query_start_loc
        s, pos = int(np.searchsorted(qsl, t, side="right")) - 1, int(batch.position_ids[t])
        ctx = np.arange(max(0, pos - self.sliding_window + 1) if self.sliding_window else 0, pos + 1)
        blocks = batch.block_tables[s, ctx // bs]
        assert (blocks >= 0).all(), f"token {t} at {pos} reads a released block: {batch.block_tables[s].tolist()}"
        tokens = self.pool[blocks, ctx % bs]
        assert (tokens >= 0).all(), f"token {t} reads an unwritten slot"
        return tokens

    def logits_for(self, tokens: np.ndarray) -> np.ndarray:
        """The model: a smooth, context-dependent score over the vocabulary."""
        h = int((tokens * (np.arange(len(tokens)) % 7 + 1)).sum() * 2654435761 % 1000003)
        v = np.arange(self.vocab_size)
        return (3.0 * np.cos(v * (h % 89 + 1) * 0.37 + h) + (v == h % self.vocab_size) * 2.0).astype(np.float32)


class CharTokenizer:
    """Token t <-> one printable character; enough for the engine's text paths in tests."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?-_+=*/()[]{}<>'\"@#$%^&|~`\\"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.ALPHABET[i % len(self.ALPHABET)] for i in ids)

    def id_to_token(self, token_id: int) -> str | None:
        return self.ALPHABET[token_id] if 0 <= token_id < len(self.ALPHABET) else None

    tool_family = None  # its template takes no tools

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        turns = "".join(f"{m['role']}:{m['content']};" for m in messages)
        return turns + ("assistant:" if add_generation_prompt else "")


def make_fake_engine(num_blocks: int, block_size: int = 4, vocab_size: int = 64, max_seq_len: int = 64,
                     max_num_tokens: int = 32, config=None):
    """An Engine over FakeModelRunner and CharTokenizer (eos: token 0)."""
    return make_windowed_fake_engine(num_blocks, 0, release=True, vocab_size=vocab_size, block_size=block_size,
                                     max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, config=config)


def make_windowed_fake_engine(num_blocks: int, sliding_window: int, release: bool = True, **options):
    """make_fake_engine's Engine over a model that reads the last sliding_window positions only; its block manager
    releases the blocks behind the window unless release is False. options: make_fake_engine's."""
    from kiln.runtime.engine import Engine, EngineLimits
    from kiln.runtime.params import RuntimeConfig

    runner = FakeModelRunner(num_blocks, options.get("block_size", 4), options.get("vocab_size", 64), sliding_window)
    limits = EngineLimits(max_seq_len=options.get("max_seq_len", 64), max_num_tokens=options.get("max_num_tokens", 32),
                          eos_token_ids=(0,), sliding_window=sliding_window if release else 0)
    return Engine(runner, CharTokenizer(), options.get("config") or RuntimeConfig(), limits, model_name="fake")
