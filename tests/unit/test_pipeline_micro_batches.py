"""A pipeline step's micro-batches (runtime/pipeline/micro_batch.py): each a consistent BatchInput of whole
sequences, and their outputs joined back row for row, checked against a stand-in stage that computes every
output row from the arrays of the batch it is given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln.errors import InvalidParamError
from kiln.runtime.model_runner import BatchInput, Chunk, RunnerOutput, pack_chunks
from kiln.runtime.params import RuntimeConfig
from kiln.runtime.pipeline.micro_batch import join_outputs, micro_batch_count, split_batch

# a prefill chunk from 0, a decode, a later chunk, two decodes, a speculative verification of 3 rows
CHUNKS = [Chunk(0, list(range(10, 27)), [3, 4]), Chunk(40, [7], [5, 6, 7]), Chunk(16, list(range(30, 38)), [8, 9]),
          Chunk(5, [8], [10]), Chunk(9, [9], [11]), Chunk(20, [1, 2, 3], [12, 13])]


def step_batch() -> BatchInput:
    """CHUNKS packed as the engine packs a mixed step: logits for each chunk's last row, all 3 rows of the
    verification; Medusa rows at two of them; an image run in the first chunk, attend_until set."""
    batch = pack_chunks(CHUNKS, False)
    qsl = batch.query_start_loc
    rows = np.concatenate([qsl[1:-1] - 1, np.arange(qsl[-2], qsl[-1])]).astype(np.int64)
    until = batch.position_ids.astype(np.int32)
    until[2:6] = 5
    return dataclasses.replace(batch, logits_indices=rows, num_logits=len(rows), medusa_indices=rows[[1, -1]],
                               image_rows=np.array([2, 3, 4, 5, 20], dtype=np.int64),
                               image_embeds=np.arange(10, dtype=np.float32).reshape(5, 2), attend_until=until)


def stand_in_stage(batch: BatchInput) -> RunnerOutput:
    """An output row per logits row (and per Medusa row) made of what the batch says of that row's token: its id,
    position, its sequence's context length and first block; wrong wherever a micro-batch's arrays disagree."""
    def describe(indices: np.ndarray) -> np.ndarray:
        seq = np.searchsorted(batch.query_start_loc, indices, side="right") - 1
        return np.stack([batch.input_ids[indices], batch.position_ids[indices], batch.seq_lens[seq],
                         batch.block_tables[seq, 0]], axis=1).astype(np.float32)

    medusa = np.zeros(0, dtype=np.int64) if batch.medusa_indices is None else batch.medusa_indices
    return RunnerOutput(describe(batch.logits_indices), describe(medusa)[:, None, :].repeat(2, axis=1))


@pytest.mark.parametrize("count", range(1, len(CHUNKS) + 1))
def test_micro_batches_hold_whole_sequences_and_join_back_in_row_order(count):
    batch = step_batch()
    pieces = split_batch(batch, count)
    assert len(pieces) == count
    for piece in (p.batch for p in pieces):
        qsl = piece.query_start_loc
        assert qsl[0] == 0 and qsl[-1] == piece.num_tokens and len(qsl) == len(piece.seq_lens) + 1
        assert len(piece.block_tables) == len(piece.seq_lens) > 0
        assert piece.num_logits == len(piece.logits_indices) and (piece.logits_indices < piece.num_tokens).all()
        assert len(piece.attend_until) == piece.num_tokens
    for name in ("input_ids", "position_ids", "seq_lens", "block_tables", "attend_until"):
        np.testing.assert_array_equal(np.concatenate([getattr(p.batch, name) for p in pieces]), getattr(batch, name))
    images = [(p.batch.input_ids[p.batch.image_rows], p.batch.image_embeds) for p in pieces
              if p.batch.image_rows is not None]
    np.testing.assert_array_equal(np.concatenate([ids for ids, _ in images]), batch.input_ids[batch.image_rows])
    np.testing.assert_array_equal(np.concatenate([embeds for _, embeds in images]), batch.image_embeds)

    joined = join_outputs(batch, pieces, [stand_in_stage(p.batch) for p in pieces])
    whole = stand_in_stage(batch)
    np.testing.assert_array_equal(joined.logits, whole.logits)
    np.testing.assert_array_equal(joined.medusa_logits, whole.medusa_logits)
    assert joined.medusa_hidden is None


def test_a_step_without_logits_rows_keeps_one_ignored_row_in_every_micro_batch():
    prefill = pack_chunks(CHUNKS[:3], False)
    prefill = dataclasses.replace(prefill, logits_indices=prefill.logits_indices[-1:], num_logits=0)
    pieces = split_batch(prefill, 3)
    assert all(p.batch.num_logits == 0 and len(p.batch.logits_indices) == 1 for p in pieces)
    joined = join_outputs(prefill, pieces, [stand_in_stage(p.batch) for p in pieces])
    np.testing.assert_array_equal(joined.logits, stand_in_stage(prefill).logits)


def test_cuts_balance_tokens_and_leave_no_micro_batch_empty():
    long_first = pack_chunks([Chunk(0, list(range(40)), [0, 1, 2])] + [Chunk(3, [1], [3 + i]) for i in range(5)],
                             False)
    assert [len(p.batch.seq_lens) for p in split_batch(long_first, 2)] == [1, 5]
    assert [len(p.batch.seq_lens) for p in split_batch(long_first, 6)] == [1] * 6
    decodes = pack_chunks([Chunk(3, [1], [i]) for i in range(16)], False)
    assert [len(p.batch.seq_lens) for p in split_batch(decodes, 3)] == [5, 6, 5]


def test_micro_batch_count_and_bad_counts():
    assert micro_batch_count(None, 2, 16, overlaps=True) == 2
    assert micro_batch_count(None, 3, 2, overlaps=True) == 2  # never more than the step has sequences
    assert micro_batch_count(None, 3, 16, overlaps=False) == 1  # stages taking turns gain nothing
    assert micro_batch_count(4, 2, 16, overlaps=False) == 4 and micro_batch_count(4, 2, 3, overlaps=True) == 3
    with pytest.raises(ValueError, match="a step of 6 sequences splits into 1..6 micro-batches, not 7"):
        split_batch(step_batch(), 7)
    with pytest.raises(InvalidParamError, match="pipeline_micro_batches must be >= 1, got 0"):
        RuntimeConfig(pipeline_micro_batches=0)


class RecordingStage:
    """A stand-in stage actor: `run.remote` records the call and returns a reference naming it."""

    def __init__(self, index: int, log: list) -> None:
        self.index, self.log = index, log
        self.run = self

    def remote(self, batch: BatchInput, previous: object) -> tuple:
        ref = ("ref", self.index, batch.num_tokens)
        self.log.append(("submit", self.index, batch.num_tokens, previous))
        return ref


def test_ray_chain_submits_every_micro_batch_before_waiting(monkeypatch):
    """Every stage call of every micro-batch is in flight before the engine waits, stage k+1's call on stage k's
    reference of the same micro-batch: what lets the actors overlap."""
    ray = pytest.importorskip("ray")
    from kiln.runtime.pipeline.ray_stages import RayChain, StageDescription
    from kiln.runtime.pipeline.shape import PipelineShape

    log: list = []
    monkeypatch.setattr(ray, "get", lambda refs: log.append(("wait", list(refs))) or [f"result {r[2]}" for r in refs])
    described = [StageDescription(i == 1, PipelineShape(4, 8), 100 + i, 0) for i in range(2)]
    chain = RayChain([RecordingStage(0, log), RecordingStage(1, log)], None, described)
    pieces = [p.batch for p in split_batch(step_batch(), 2)]
    sizes = [p.num_tokens for p in pieces]
    assert chain.run(pieces) == [f"result {n}" for n in sizes]
    assert log == [("submit", 0, sizes[0], None), ("submit", 1, sizes[0], ("ref", 0, sizes[0])),
                   ("submit", 0, sizes[1], None), ("submit", 1, sizes[1], ("ref", 0, sizes[1])),
                   ("wait", [("ref", 1, sizes[0]), ("ref", 1, sizes[1])])]
