"""The seam between policy and mechanism: BatchInput (numpy, per kiln/contract.py) and ModelRunner.

The scheduler's output becomes one packed ragged batch; a ModelRunner (ONNX Runtime here,
TensorRT elsewhere, a fake in tests) turns it into logits for the rows that need them.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from kiln import contract
from kiln.errors import InvalidParamError, KilnError
from kiln.runtime.kv_transfer import KvLayout
from kiln.runtime.outputs import RankTotals, StageTotals
from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.sequence import Sequence
from kiln.runtime.vision.prompt import attend_until, image_rows


@dataclass(frozen=True)
class BatchInput:
    input_ids: np.ndarray  # int64 [T]
    position_ids: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [S+1]
    seq_lens: np.ndarray  # int32 [S], context length after this step
    block_tables: np.ndarray  # int32 [S, max_blocks]
    logits_indices: np.ndarray  # int64 [L]
    num_logits: int  # rows of the result that are real (logits_indices may carry one dummy row)
    # int64 [M]: rows that need the Medusa heads' logits too (engines with heads; None: no row)
    medusa_indices: np.ndarray | None = None
    # A vision-language engine's image rows (kiln/vision.py): float32 [N, hidden] embeddings for the int64 [N]
    # rows of the packed batch they replace (None: no image row in this step)
    image_embeds: np.ndarray | None = None
    image_rows: np.ndarray | None = None
    # int32 [T]: the last position each token sees (kiln/paged_attention.py), where a chunk holds a bidirectional
    # image run (Gemma 3); None: causal
    attend_until: np.ndarray | None = None

    FEEDS = (contract.INPUT_IDS, contract.POSITION_IDS, contract.QUERY_START_LOC, contract.SEQ_LENS,
             contract.BLOCK_TABLES, contract.LOGITS_INDICES)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def feeds(self) -> dict[str, np.ndarray]:
        return {
            contract.INPUT_IDS: self.input_ids,
            contract.POSITION_IDS: self.position_ids,
            contract.QUERY_START_LOC: self.query_start_loc,
            contract.SEQ_LENS: self.seq_lens,
            contract.BLOCK_TABLES: self.block_tables,
            contract.LOGITS_INDICES: self.logits_indices,
        }


_Layout = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _pack(starts: list[int], token_runs: list[list[int]], block_tables: list[list[int]]) -> _Layout:
    """(input_ids, position_ids, query_start_loc, seq_lens, block_tables) of rows whose new tokens
    token_runs[r] start at absolute position starts[r]: the layout both packers share."""
    num_rows = len(starts)
    start = np.array(starts, dtype=np.int64)
    counts = np.fromiter((len(run) for run in token_runs), dtype=np.int64, count=num_rows)
    qsl = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(counts, out=qsl[1:])
    num_tokens = int(qsl[-1])
    input_ids = np.fromiter(itertools.chain.from_iterable(token_runs), dtype=np.int64, count=num_tokens)
    # Token i of row r sits at position start[r] + (i - qsl[r]).
    position_ids = np.arange(num_tokens, dtype=np.int64) + np.repeat(start - qsl[:-1], counts)
    seq_lens = (start + counts).astype(np.int32)
    lengths = np.fromiter((len(table) for table in block_tables), dtype=np.int64, count=num_rows)
    tables = np.zeros((num_rows, int(lengths.max())), dtype=np.int32)
    in_table = np.arange(tables.shape[1]) < lengths[:, None]
    tables[in_table] = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32,
                                   count=int(lengths.sum()))
    return input_ids, position_ids, qsl, seq_lens, tables


def _pack_decodes(seqs: list[Sequence], logits_indices: np.ndarray) -> BatchInput:
    """build_batch for a step of decodes only (one new token each, all needing logits): the same arrays from
    plain lists, in a few numpy calls (_pack's dozen cost a single-stream step ~0.1 ms of Python)."""
    positions = [seq.num_computed_tokens for seq in seqs]
    input_ids = np.array([seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)], dtype=np.int64)
    position_ids = np.array(positions, dtype=np.int64)
    rows = np.arange(len(seqs) + 1, dtype=np.int32)
    width = max(len(seq.block_table) for seq in seqs)
    tables = [seq.block_table if len(seq.block_table) == width else
              seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
    return BatchInput(input_ids, position_ids, rows, (position_ids + 1).astype(np.int32),
                      np.array(tables, dtype=np.int32), logits_indices, len(seqs))


def build_batch(out: SchedulerOutput) -> BatchInput:
    """Pack the new tokens of each scheduled sequence (from its num_computed_tokens on) and its
    speculative tokens; logits, and the Medusa heads' rows, where out.logits_rows places them."""
    rows = out.logits_rows
    if out.is_decode_only and not any(seq.images_pending for seq, _ in out.scheduled):
        batch = _pack_decodes([seq for seq, _ in out.scheduled], rows.token_indices)
    else:
        batch = _pack_scheduled(out)
    if rows.heads.size:
        batch = dataclasses.replace(batch, medusa_indices=rows.token_indices[rows.heads])
    return batch


def _pack_scheduled(out: SchedulerOutput) -> BatchInput:
    """build_batch for any step."""
    scheduled = out.scheduled
    starts = [seq.num_computed_tokens for seq, _ in scheduled]
    runs = [seq.token_ids[c:c + n] for (seq, n), c in zip(scheduled, starts, strict=True)]
    if out.proposals:
        runs = [run + list(proposal) for run, proposal in zip(runs, out.proposals, strict=True)]
    input_ids, position_ids, qsl, seq_lens, tables = _pack(starts, runs, [seq.block_table for seq, _ in scheduled])
    rows = out.logits_rows.token_indices
    # A step of prefill chunks only still asks for one (ignored) row: some backends dislike empty gathers.
    logits_indices = rows if rows.size else np.array([int(qsl[-1]) - 1], dtype=np.int64)
    batch = BatchInput(input_ids, position_ids, qsl, seq_lens, tables, logits_indices, int(rows.size))
    parts = [part for r, ((seq, n), c) in enumerate(zip(scheduled, starts, strict=True)) if seq.images_pending
             for part in image_rows(seq.images, c, n, int(qsl[r]))]
    if not parts:
        return batch
    return dataclasses.replace(batch, image_rows=np.concatenate([part[0] for part in parts]),
                               image_embeds=np.concatenate([part[1] for part in parts]),
                               attend_until=_attend_until(scheduled, starts, batch))


def _attend_until(scheduled: tuple[tuple[Sequence, int], ...], starts: list[int],
                  batch: BatchInput) -> np.ndarray | None:
    """The step's attend_until: each token's own position, an image run's last for the run's tokens."""
    until: np.ndarray | None = None
    for r, ((seq, n), c) in enumerate(zip(scheduled, starts, strict=True)):
        bounds = attend_until(seq.images, c, n) if seq.images_pending else None
        if bounds is not None:
            if until is None:
                until = batch.position_ids.astype(np.int32)
            row = int(batch.query_start_loc[r])
            until[row:row + n] = bounds
    return until


@dataclass(frozen=True)
class RunnerOutput:
    """What one step returns: the logits, and what the engine's Medusa heads need where it has heads."""

    logits: np.ndarray  # float32 [len(logits_indices), vocab_size]
    medusa_logits: np.ndarray | None = None  # float32 [len(medusa_indices), num_medusa_heads, vocab_size]
    medusa_hidden: np.ndarray | None = None  # float32 [len(medusa_indices), hidden_size] (hydra heads)

    def extras(self) -> dict[str, np.ndarray]:
        """The outputs beside the logits, by graph output name (what Proposer.observe reads)."""
        found = ((contract.MEDUSA_LOGITS, self.medusa_logits), (contract.MEDUSA_HIDDEN, self.medusa_hidden))
        return {name: value for name, value in found if value is not None}


class KvLostError(RuntimeError):
    """The runner's pools lost their contents (a pipeline stage's process died and was started again): no block
    the BlockManager holds has its K/V any more. The engine fails the requests holding blocks and forgets the
    prefix cache."""


class ModelRunner(abc.ABC):
    """Runs one packed batch through the model, writing K/V into its paged pools in place."""

    num_blocks: int
    block_size: int
    vocab_size: int
    num_medusa_heads: int = 0  # K of an engine built with --medusa (kiln/medusa.py)
    medusa_output: str | None = None  # the graph output its heads add (contract.MEDUSA_LOGITS or _HIDDEN), if any

    @abc.abstractmethod
    def execute(self, batch: BatchInput) -> np.ndarray:
        """float32 logits [len(batch.logits_indices), vocab_size]."""

    def execute_all(self, batch: BatchInput) -> RunnerOutput:
        """The logits and, for an engine with Medusa heads, their logits at batch.medusa_indices."""
        if batch.medusa_indices is not None and len(batch.medusa_indices):
            raise ValueError(f"{type(self).__name__} has no Medusa heads; leave medusa_indices unset")
        return RunnerOutput(self.execute(batch))

    def stage_totals(self) -> StageTotals:
        """A pipeline's per-stage time and bytes handed between stages; empty for one graph."""
        return StageTotals()

    def rank_totals(self) -> RankTotals:
        """A tensor-parallel engine's per-rank time and all-reduce waits and bytes; empty for one graph."""
        return RankTotals()

    def kv_layout(self) -> KvLayout:
        """The shape and dtype of one block of the pools (what read/write_kv_blocks move)."""
        raise KilnError(f"{type(self).__name__} cannot export or import KV blocks")

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        """A copy of these blocks of every layer's pool: [num_layers, len(block_ids), *block_shape]."""
        raise KilnError(f"{type(self).__name__} cannot export or import KV blocks")

    def write_kv_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        """Overwrite these blocks of every layer's pool with read_kv_blocks' layout."""
        raise KilnError(f"{type(self).__name__} cannot export or import KV blocks")

    def close(self) -> None:  # noqa: B027 - optional
        pass


@dataclass(frozen=True)
class Chunk:
    """New tokens of one sequence, from absolute position `start` on, whose K/V live in `block_table`."""

    start: int
    tokens: list[int]
    block_table: list[int]

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"chunk start must be >= 0, got {self.start}")
        if not self.tokens:
            raise ValueError("chunk tokens must not be empty")


def pack_chunks(chunks: list[Chunk], all_rows: bool) -> BatchInput:
    """One packed batch of chunks, asking for logits of every row (all_rows) or each chunk's last row.

    For drivers that place sequences themselves (evaluation, tests); the engine packs its
    scheduled sequences with build_batch.
    """
    input_ids, position_ids, qsl, seq_lens, tables = _pack(
        [c.start for c in chunks], [c.tokens for c in chunks], [c.block_table for c in chunks]
    )
    rows = np.arange(qsl[-1], dtype=np.int64) if all_rows else qsl[1:].astype(np.int64) - 1
    return BatchInput(input_ids, position_ids, qsl, seq_lens, tables, rows, len(rows))


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


@dataclass(frozen=True)
class KvBudget:
    """How the KV pool is sized (RuntimeConfig's fields) and what it must hold."""

    bytes_per_block: int  # all layers' K and V of one block
    block_size: int
    min_tokens: int  # one sequence of the served max_model_len: any accepted request can finish
    max_useful_tokens: int  # max_num_seqs sequences of max_model_len: the default budget's cap


def choose_num_blocks(budget: KvBudget, kv_cache_bytes: int | None, kv_cache_fraction: float | None,
                      available: int | None = None) -> int:
    """Blocks in each layer's pool: an explicit byte budget, or a fraction of available memory.

    The default (neither given) is 10% of available memory, capped at what max_num_seqs
    sequences of max_model_len tokens could ever use and raised to one such sequence. A pool
    that cannot hold one max_model_len sequence, or that is larger than the available memory,
    is refused with one sentence naming the setting to change (it would fail under load).
    """
    available = available_memory_bytes() if available is None else available
    bpb = budget.bytes_per_block
    min_blocks = -(-budget.min_tokens // budget.block_size)
    need = f"one sequence of max_model_len {budget.min_tokens} tokens needs {min_blocks * bpb:,} bytes"
    if kv_cache_bytes is not None:
        if kv_cache_bytes > available:
            raise InvalidParamError(f"kv_cache_bytes {kv_cache_bytes:,} is more than the available memory "
                                    f"({available:,} bytes); lower it", "kv_cache_bytes")
        blocks = kv_cache_bytes // bpb
        if blocks < min_blocks:
            raise InvalidParamError(f"kv_cache_bytes {kv_cache_bytes:,} holds {blocks * budget.block_size} tokens but "
                                    f"{need}; raise it or lower max_model_len", "kv_cache_bytes")
        return blocks
    if kv_cache_fraction is not None:
        blocks = int(available * kv_cache_fraction) // bpb
        if blocks < min_blocks:
            raise InvalidParamError(f"kv_cache_fraction {kv_cache_fraction} of the available memory holds "
                                    f"{blocks * budget.block_size} tokens but {need}; raise it or lower "
                                    "max_model_len", "kv_cache_fraction")
        return blocks
    if min_blocks * bpb > available:
        raise InvalidParamError(f"{need}, more than the available memory ({available:,} bytes); lower max_model_len",
                                "max_model_len")
    max_useful = -(-budget.max_useful_tokens // budget.block_size)
    return max(min(int(available * 0.1) // bpb, max_useful), min_blocks)


# A default pool grows past a tenth of memory to hold one full-context sequence, but never past this share.
DEFAULT_POOL_MAX_FRACTION = 0.5


def fit_num_blocks(budget: KvBudget, kv_cache_bytes: int | None, kv_cache_fraction: float | None,
                   available: int | None = None) -> int:
    """Blocks in each layer's pool when max_model_len is left to its default (the engine's max_seq_len,
    budget.min_tokens): sized as choose_num_blocks sizes it, except that a pool holding fewer tokens than one
    such sequence serves what it holds instead of failing (the caller shortens the served context and says
    so, short_context_warning), and a default pool grows to one full sequence only up to
    DEFAULT_POOL_MAX_FRACTION of the available memory: a 128k-token model must not take all of it by default.
    A pool that holds not even one block is refused."""
    available = available_memory_bytes() if available is None else available
    bpb, min_blocks = budget.bytes_per_block, -(-budget.min_tokens // budget.block_size)
    if kv_cache_bytes is not None:
        if kv_cache_bytes > available:
            raise InvalidParamError(f"kv_cache_bytes {kv_cache_bytes:,} is more than the available memory "
                                    f"({available:,} bytes); lower it", "kv_cache_bytes")
        blocks, setting = kv_cache_bytes // bpb, f"kv_cache_bytes {kv_cache_bytes:,}"
    elif kv_cache_fraction is not None:
        blocks, setting = int(available * kv_cache_fraction) // bpb, f"kv_cache_fraction {kv_cache_fraction}"
    else:
        max_useful = -(-budget.max_useful_tokens // budget.block_size)
        blocks = min(int(available * 0.1) // bpb, max_useful)
        blocks = max(blocks, min(min_blocks, int(available * DEFAULT_POOL_MAX_FRACTION) // bpb))
        setting = f"half the available memory ({available:,} bytes)"
    if blocks < 1:
        raise InvalidParamError(f"{setting} holds no block of {budget.block_size} tokens ({bpb:,} bytes); a KV pool "
                                "needs at least one", "kv_cache_bytes" if kv_cache_bytes is not None else
                                "kv_cache_fraction" if kv_cache_fraction is not None else "max_model_len")
    return blocks


def short_context_warning(budget: KvBudget, num_blocks: int) -> str | None:
    """The sentence a server logs when its pool cannot hold one sequence of the engine's context, else None."""
    tokens = num_blocks * budget.block_size
    if tokens >= budget.min_tokens:
        return None
    need = -(-budget.min_tokens // budget.block_size) * budget.bytes_per_block
    mib = num_blocks * budget.bytes_per_block / 2**20
    return (f"the KV pool ({mib:.1f} MiB) holds {tokens} tokens, fewer than one sequence of the engine's context "
            f"needs ({budget.min_tokens} tokens, {need:,} bytes): serving sequences of up to {tokens} tokens; pass "
            f"--kv-cache-bytes {need} (or more) to serve the full context, or --max-model-len to choose a shorter one")
