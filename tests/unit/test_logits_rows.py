"""The step's logits-row layout (SchedulerOutput.logits_rows), laid out once and read by the batch, the
sampler and verification, and the Medusa heads: pinned by hand on a mixed step, and checked against a
token-by-token reference over random steps."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kiln.runtime.model_runner import build_batch
from kiln.runtime.params import SamplingParams
from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.sequence import Sequence

P = SamplingParams(temperature=0)


def seq(computed: int, length: int, block_size: int = 4) -> Sequence:
    """A sequence of `length` tokens, `computed` of them computed, with blocks for all of them."""
    s = Sequence([(7 * i) % 50 + 1 for i in range(length)], P)
    s.num_computed_tokens = computed
    s.block_table = list(range(-(-(length + 8) // block_size)))
    return s


def mixed_step() -> SchedulerOutput:
    """A decode with 2 proposals, a prefill chunk short of its prompt's end, the last chunk of a prompt, a
    decode with 3 proposals, a plain decode."""
    a, b, c, d, e = seq(9, 10), seq(0, 12), seq(5, 8), seq(6, 7), seq(3, 4)
    return SchedulerOutput(((a, 1), (b, 5), (c, 3), (d, 1), (e, 1)), (True, False, True, True, True), (),
                           ((4, 5), (), (), (1, 2, 3), ()), (1, 0, 1, 4, 0))


def test_a_mixed_step_lays_out_its_rows_by_hand():
    out = mixed_step()
    rows = out.logits_rows
    # packed tokens: a 0-2 (its token, 2 proposals), b 3-7, c 8-10, d 11-14, e 15
    assert rows.token_indices.tolist() == [0, 1, 2, 10, 11, 12, 13, 14, 15]
    assert rows.starts == (0, 3, 4, 8) and rows.counts == (3, 1, 4, 1) and rows.num_rows == 9
    assert rows.heads.tolist() == [0, 3, 4, 5, 6, 7]  # a's first row, c's row, all four of d's
    batch = build_batch(out)
    assert batch.logits_indices.tolist() == rows.token_indices.tolist() and batch.num_logits == 9
    assert batch.medusa_indices is not None and batch.medusa_indices.tolist() == [0, 10, 11, 12, 13, 14]
    assert batch.query_start_loc.tolist() == [0, 3, 8, 11, 15, 16]


def test_steps_without_logits_or_heads():
    a, b = seq(0, 12), seq(5, 8)
    chunks = SchedulerOutput(((a, 5), (b, 2)), (False, False))
    assert chunks.logits_rows.num_rows == 0 and chunks.logits_rows.starts == ()
    batch = build_batch(chunks)  # one ignored row: some backends dislike empty gathers
    assert batch.logits_indices.tolist() == [6] and batch.num_logits == 0 and batch.medusa_indices is None
    decodes = SchedulerOutput(((seq(3, 4), 1), (seq(7, 8), 1)), (True, True))
    assert decodes.is_decode_only and decodes.logits_rows.token_indices.tolist() == [0, 1]
    assert decodes.logits_rows.heads.size == 0 and build_batch(decodes).medusa_indices is None


def test_medusa_rows_are_checked_against_the_rows_a_sequence_has():
    a, b = seq(9, 10), seq(0, 12)
    with pytest.raises(ValueError, match=r"medusa_rows\[0\] is 3, outside"):
        SchedulerOutput(((a, 1),), (True,), (), ((4,),), (3,))
    with pytest.raises(ValueError, match=r"medusa_rows\[1\] is 1, outside"):
        SchedulerOutput(((a, 1), (b, 5)), (True, False), (), (), (1, 1))
    with pytest.raises(ValueError, match="medusa_rows has 1 entries for 2"):
        SchedulerOutput(((a, 1), (b, 5)), (True, False), (), (), (1,))


def reference(out: SchedulerOutput) -> tuple[list[int], list[int], list[int], list[int]]:
    """Token by token: (token_indices, starts, counts, heads) as the verification reads them."""
    token, tokens, starts, counts, heads = 0, [], [], [], []
    for r, ((_, n), need) in enumerate(zip(out.scheduled, out.needs_logits, strict=True)):
        k = len(out.proposals_of(r))
        token += n + k
        if need:
            starts.append(len(tokens))
            counts.append(k + 1)
            heads += [len(tokens) + j for j in range(out.medusa_rows[r] if out.medusa_rows else 0)]
            tokens += list(range(token - k - 1, token))
    return tokens, starts, counts, heads


@pytest.mark.parametrize("seed", range(200))
def test_random_steps_match_the_token_by_token_reference(seed):
    rng = random.Random(seed)
    scheduled, needs, proposals, medusa = [], [], [], []
    for _ in range(rng.randrange(1, 7)):
        kind = rng.choice(("decode", "chunk", "last chunk"))
        length = rng.randrange(2, 20)
        n = 1 if kind == "decode" else rng.randrange(1, length)
        need = kind != "chunk"
        k = rng.randrange(0, 4) if kind == "decode" else 0
        scheduled.append((seq(length - n, length) if need else seq(0, length + 1), n))
        needs.append(need)
        proposals.append(tuple(range(1, k + 1)))
        medusa.append(rng.randrange(0, k + 2) if need else 0)
    with_proposals = any(proposals) or rng.random() < 0.5
    out = SchedulerOutput(tuple(scheduled), tuple(needs), (), tuple(proposals) if with_proposals else (),
                          tuple(medusa) if rng.random() < 0.7 else ())
    tokens, starts, counts, heads = reference(out)
    rows = out.logits_rows
    assert (rows.token_indices.tolist(), list(rows.starts), list(rows.counts), rows.heads.tolist()) == \
        (tokens, starts, counts, heads)
    assert rows.token_indices.dtype == rows.heads.dtype == np.int64
    batch = build_batch(out)
    assert batch.num_logits == len(tokens) and batch.logits_indices[:len(tokens)].tolist() == tokens
    assert (batch.medusa_indices.tolist() if batch.medusa_indices is not None else []) == \
        [tokens[h] for h in heads]
