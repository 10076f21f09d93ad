"""Micro-batches of a pipeline step: a step's BatchInput cut into M BatchInputs by whole sequences, and their
last-stage outputs joined back into the step's output, row for row.

While stage k computes micro-batch j, stage k+1 computes micro-batch j-1, so N stages in their own processes
overlap instead of taking turns. Sequences in different micro-batches write different KV blocks, and a block
the prefix cache shares is only read within a step, so the micro-batches of one step never conflict.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kiln.runtime.model_runner import BatchInput, RunnerOutput


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch and where its output rows go in the step's output."""

    batch: BatchInput
    logits_rows: np.ndarray  # int64: for each of its first len(logits_rows) logits rows, the step's row
    medusa_rows: np.ndarray  # int64: for each of its Medusa rows, the step's row


def micro_batch_count(requested: int | None, num_stages: int, num_seqs: int, overlaps: bool) -> int:
    """How many micro-batches a step of num_seqs sequences runs as: `requested` (None: the stage count where the
    stages overlap, 1 where they take turns), never more than the step has sequences."""
    if requested is None:
        requested = num_stages if overlaps else 1
    return max(1, min(requested, num_seqs))


def _cut_points(query_start_loc: np.ndarray, count: int) -> list[int]:
    """Sequence indices [0, c1, ..., S] cutting S sequences into `count` non-empty contiguous runs of about equal
    token counts (a prefill chunk weighs its tokens, a decode one)."""
    num_seqs = len(query_start_loc) - 1
    total = int(query_start_loc[-1])
    cuts = [0]
    for j in range(1, count):
        nearest = int(np.abs(query_start_loc - total * j / count).argmin())
        # each run keeps at least one sequence, before and after this cut
        cuts.append(min(max(nearest, cuts[-1] + 1), num_seqs - (count - j)))
    cuts.append(num_seqs)
    return cuts


def _rows_within(indices: np.ndarray, first: int, end: int) -> np.ndarray:
    """Positions in `indices` (token rows of the step) of those in [first, end), in their order."""
    return np.flatnonzero((indices >= first) & (indices < end)).astype(np.int64)


def _piece(batch: BatchInput, seq_first: int, seq_end: int) -> MicroBatch:
    qsl = batch.query_start_loc
    first, end = int(qsl[seq_first]), int(qsl[seq_end])
    logits_rows = _rows_within(batch.logits_indices, first, end)
    logits_indices = batch.logits_indices[logits_rows] - first
    num_logits = int(np.count_nonzero(logits_rows < batch.num_logits))  # a step's real rows come first
    if not len(logits_indices):  # a step without a logits row still asks for one (ignored): see build_batch
        logits_indices = np.array([end - first - 1], dtype=np.int64)
    medusa_rows = np.zeros(0, dtype=np.int64)
    medusa_indices = None
    if batch.medusa_indices is not None:
        medusa_rows = _rows_within(batch.medusa_indices, first, end)
        medusa_indices = batch.medusa_indices[medusa_rows] - first
    image_rows = image_embeds = None
    if batch.image_rows is not None and batch.image_embeds is not None:
        images = _rows_within(batch.image_rows, first, end)
        if len(images):
            image_rows, image_embeds = batch.image_rows[images] - first, batch.image_embeds[images]
    piece = BatchInput(
        input_ids=batch.input_ids[first:end],
        position_ids=batch.position_ids[first:end],
        query_start_loc=(qsl[seq_first:seq_end + 1] - first).astype(np.int32),
        seq_lens=batch.seq_lens[seq_first:seq_end],
        block_tables=batch.block_tables[seq_first:seq_end],
        logits_indices=logits_indices,
        num_logits=num_logits,
        medusa_indices=medusa_indices,
        image_embeds=image_embeds,
        image_rows=image_rows,
        attend_until=None if batch.attend_until is None else batch.attend_until[first:end],  # positions: unshifted
    )
    return MicroBatch(piece, logits_rows, medusa_rows)


def split_batch(batch: BatchInput, count: int) -> list[MicroBatch]:
    """`batch` as `count` micro-batches of whole sequences, in sequence order (count: 1..its sequences)."""
    num_seqs = len(batch.seq_lens)
    if not 1 <= count <= num_seqs:
        raise ValueError(f"a step of {num_seqs} sequences splits into 1..{num_seqs} micro-batches, not {count}")
    if count == 1:
        return [MicroBatch(batch, np.arange(len(batch.logits_indices), dtype=np.int64),
                           np.arange(0 if batch.medusa_indices is None else len(batch.medusa_indices),
                                     dtype=np.int64))]
    cuts = _cut_points(batch.query_start_loc, count)
    return [_piece(batch, a, b) for a, b in itertools.pairwise(cuts)]


def _join(step_rows: int, parts: list[tuple[np.ndarray, np.ndarray | None]]) -> np.ndarray | None:
    """Rows scattered back from parts of (step rows, their values), the values perhaps with trailing rows no step
    row takes (a micro-batch's own ignored logits row); None where a part has no values (no such output)."""
    present = [(rows, values) for rows, values in parts if values is not None]
    if len(present) < len(parts):
        return None
    template = present[0][1]
    joined = np.empty((step_rows, *template.shape[1:]), dtype=template.dtype)
    for rows, values in present:
        joined[rows] = values[:len(rows)]
    return joined


def join_outputs(batch: BatchInput, pieces: list[MicroBatch], outputs: list[RunnerOutput]) -> RunnerOutput:
    """The step's output from its micro-batches' outputs: every row where `batch` has it."""
    if len(pieces) == 1:
        return outputs[0]
    paired = list(zip(pieces, outputs, strict=True))
    logits = _join(len(batch.logits_indices), [(p.logits_rows, o.logits) for p, o in paired])
    assert logits is not None
    num_medusa = 0 if batch.medusa_indices is None else len(batch.medusa_indices)
    return RunnerOutput(logits, _join(num_medusa, [(p.medusa_rows, o.medusa_logits) for p, o in paired]),
                        _join(num_medusa, [(p.medusa_rows, o.medusa_hidden) for p, o in paired]))
