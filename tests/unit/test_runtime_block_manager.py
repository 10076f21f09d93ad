"""BlockManager: exact block ids, prefix hits, LRU eviction order, fork, invariants."""

import pytest

from kiln.runtime.block_manager import RELEASED, BlockManager
from kiln.runtime.params import SamplingParams
from kiln.runtime.sequence import Sequence

P = SamplingParams(temperature=0)


def seq(tokens) -> Sequence:
    return Sequence(list(tokens), P)


def run(bm: BlockManager, s: Sequence, num_tokens: int | None = None) -> None:
    """Allocate and 'compute' the first num_tokens tokens (default: all), as a step would."""
    n = len(s) if num_tokens is None else num_tokens
    assert bm.allocate(s, n)
    s.num_computed_tokens = n
    bm.commit(s)
    bm.check()


def test_allocation_takes_lowest_free_ids_in_order():
    bm = BlockManager(6, block_size=4)
    a = seq(range(10))
    assert bm.match_prefix(a) == 0
    run(bm, a)
    assert a.block_table == [0, 1, 2]
    assert list(bm.free_ids) == [3, 4, 5]
    assert len(a.block_hashes) == 2  # only full blocks are hashed
    assert bm.blocks[2].hash is None


def test_free_puts_tail_first_and_prefix_hit_reuses_blocks():
    bm = BlockManager(6, block_size=4)
    a = seq(range(10))
    run(bm, a)
    bm.free(a)
    assert list(bm.free_ids) == [3, 4, 5, 2, 1, 0]  # LRU order: tail of a evicted before its head
    b = seq(list(range(8)) + [50, 51, 52])
    assert bm.match_prefix(b) == 8
    assert b.block_table == [0, 1] and b.num_computed_tokens == 0  # the scheduler records the hit
    b.num_computed_tokens = 8
    run(bm, b)
    assert b.block_table == [0, 1, 3]
    assert list(bm.free_ids) == [4, 5, 2]


def test_lru_eviction_order_and_partial_prefix_survival():
    bm = BlockManager(6, block_size=4)
    a = seq(range(10))
    run(bm, a)
    bm.free(a)  # free: [3, 4, 5, 2, 1, 0]; cached: blocks 0, 1
    c = seq(range(100, 112))
    run(bm, c)
    assert c.block_table == [3, 4, 5]
    d = seq(range(200, 208))
    run(bm, d)
    assert d.block_table == [2, 1]  # block 1 (a's second block) evicted, block 0 still cached
    assert bm.blocks[1].hash == d.block_hashes[1]
    e = seq(list(range(8)) + [9])
    assert bm.match_prefix(e) == 4 and e.block_table == [0]
    e.num_computed_tokens = 4  # as the scheduler records a hit
    bm.check()


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(4, block_size=4)
    a = seq(range(8))
    run(bm, a)
    b = seq(range(8))  # identical, block-aligned
    assert bm.match_prefix(b) == 4
    assert b.block_table == [0]
    assert bm.blocks[0].ref_count == 2


def test_allocate_fails_without_side_effects():
    bm = BlockManager(2, block_size=4)
    a = seq(range(12))
    assert not bm.allocate(a, 12)
    assert a.block_table == [] and list(bm.free_ids) == [0, 1]
    assert bm.can_fit(a, 12) == 8
    bm.check()


def test_duplicate_content_is_hashed_once():
    bm = BlockManager(4, block_size=4)
    a, b = seq(range(4)), seq(range(4))
    run(bm, a)
    run(bm, b)
    assert a.block_hashes == b.block_hashes
    assert bm.hash_to_block[a.block_hashes[0]] == 0
    assert bm.blocks[1].hash is None  # b's copy stays unregistered; freeing it just recycles it
    bm.free(a)
    bm.free(b)
    bm.check()


def test_fork_shares_full_computed_blocks_only():
    bm = BlockManager(8, block_size=4)
    parent = seq(range(10))
    run(bm, parent)
    child = seq(range(10))
    assert bm.fork(parent, child) == 8
    assert child.block_table == [0, 1] and child.num_computed_tokens == 0
    child.num_computed_tokens = 8
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    run(bm, child)
    assert child.block_table == [0, 1, 3]
    bm.free(parent)
    assert parent.block_table == [] and parent.block_hashes == []
    assert bm.blocks[0].ref_count == 1 and 2 in bm.free_ids
    bm.free(child)
    assert bm.num_free_blocks == 8
    bm.check()


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(6, block_size=4, enable_prefix_caching=False)
    a = seq(range(10))
    run(bm, a)
    bm.free(a)
    b = seq(range(10))
    assert bm.match_prefix(b) == 0
    assert bm.hash_to_block == {}


def test_check_catches_a_hit_the_scheduler_did_not_record():
    bm = BlockManager(4, block_size=4)
    run(bm, seq(range(8)))
    b = seq(range(8))
    assert bm.match_prefix(b) == 4
    with pytest.raises(AssertionError):
        bm.check()  # b holds a hashed block but claims no computed tokens


def test_check_catches_a_broken_ref_count():
    bm = BlockManager(4, block_size=4)
    a = seq(range(5))
    run(bm, a)
    bm.blocks[0].ref_count = 2
    with pytest.raises(AssertionError):
        bm.check()


# -- sliding window: blocks behind every token's window are released while the sequence runs -----------------

def test_blocks_behind_the_window_are_released_as_the_sequence_computes():
    bm = BlockManager(4, block_size=4, sliding_window=6)
    a = seq(range(30))
    run(bm, a, 8)
    assert a.block_table == [0, 1]  # the token at 8 reads 3..8: block 0 still in use
    run(bm, a, 12)  # allocating for 8..11 (computed 8): nothing behind the window yet
    assert a.block_table == [0, 1, 2]
    run(bm, a, 16)  # computed 12: the next token reads 7..12, so block 0 (0..3) goes back
    assert a.block_table == [RELEASED, 1, 2, 3] and list(bm.free_ids) == [0]
    run(bm, a, 24)  # computed 16: the token at 16 reads 11..16, so block 1 (4..7) goes; 16..23 reuses 0 and 1
    assert a.block_table == [RELEASED, RELEASED, 2, 3, 0, 1]
    run(bm, a, 30)  # computed 24: 19..24, blocks 2 and 3 go: 30 tokens through a pool of 16 slots
    assert a.block_table == [RELEASED] * 4 + [0, 1, 2, 3] and bm.num_used_blocks == 4
    bm.free(a)
    assert bm.num_free_blocks == 4
    bm.check()


def test_a_released_block_stays_a_findable_prefix_until_evicted():
    """Its K/V is what any sequence with that prefix computes, so a later prompt with the prefix hits it."""
    bm = BlockManager(8, block_size=4, sliding_window=4)
    a = seq(range(20))
    run(bm, a, 12)
    run(bm, a, 20)
    assert a.block_table[:2] == [RELEASED, RELEASED]
    b = seq(list(range(12)) + [99, 98])
    assert bm.match_prefix(b) == 12 and b.block_table == [0, 1, 2]
    b.num_computed_tokens = 12
    bm.check()


def test_allocate_gives_no_block_to_places_behind_the_window():
    """A sequence starting with computed tokens whose K/V it need not hold (a handoff) takes blocks for the
    window only."""
    bm = BlockManager(3, block_size=4, sliding_window=4)
    a = seq(range(24))
    a.num_computed_tokens = 20
    assert bm.allocate(a, 24)
    assert a.block_table == [RELEASED] * 4 + [0, 1]
    bm.check()


def test_a_fork_shares_no_block_its_window_lost():
    bm = BlockManager(8, block_size=4, sliding_window=4)
    parent = seq(range(16))
    run(bm, parent, 12)  # the child (its 9-token prompt) would resume at 8, reading 5..8: block 1
    assert bm.allocate(parent, 16)  # computed 12: the token at 12 reads 9..12, so blocks 0 and 1 are released
    assert parent.block_table[:2] == [RELEASED, RELEASED]
    child = seq(range(9))
    assert bm.fork(parent, child) == 0 and child.block_table == []
    bm.check()


def test_check_catches_a_block_released_inside_the_window():
    bm = BlockManager(8, block_size=4, sliding_window=8)
    a = seq(range(12))
    run(bm, a)
    bm._release(a.block_table[0])  # 0..3, read by the token at 12 (5..12)? no: 12 - 8 + 1 = 5 > 3
    a.block_table[0] = RELEASED
    bm.check()
    bm._release(a.block_table[1])  # 4..7 holds 5..7, which the token at 12 reads
    a.block_table[1] = RELEASED
    with pytest.raises(AssertionError, match="a block in the window is gone"):
        bm.check()
