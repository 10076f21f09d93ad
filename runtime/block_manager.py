"""BlockManager: ref-counted KV blocks with prefix caching and LRU eviction.

A block holds block_size tokens' K/V in every layer's pool. A *full, computed* block is
identified by a chained hash, hash((previous block's hash, its token ids)), so a hash names
the whole prefix up to and including that block. Cached blocks stay findable after their
last owner frees them; they are evicted (reused for new content) only when a fresh block is
needed, least recently freed first. Within one sequence the tail is freed first, so it is
evicted before the sequence's earlier (more shareable) blocks.

The block manager writes a sequence's block table and block hashes and nothing else; it
reads num_computed_tokens, whose one writer is the scheduler (allocation results, such as
the prefix-cache hit length, are returned to it).

Sliding window (a model whose every layer attends to the last `sliding_window` positions only): a token at
position p reads keys at p - window + 1 .. p, so once a sequence has computed n tokens no token it will
compute reads a block ending before n - window + 1. `release_outside_window` gives such blocks back while the
sequence runs; their places in its block table become RELEASED (-1: the op reads no block-table entry before
the window, kiln/paged_attention.py), always a leading run of the table. A released block keeps its hash: its
K/V is what any sequence with that prefix computes (each position's K/V depends on the tokens before it
only), so it stays findable for a later prompt with the same prefix until evicted, as any freed cached block.
A sequence's blocks are thus at most those of window + one step's chunk, whatever its length.
"""

from __future__ import annotations

from collections import OrderedDict

from kiln.runtime.sequence import Sequence

NO_HASH = None
RELEASED = -1  # a block-table entry whose block was given back: before the sliding window of every token to come


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = NO_HASH
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


# The chain's root. Not None: before Python 3.12 hash(None) is the object's address, so a hash chained
# from None would differ between processes, and the cluster router hashes prompts in another process
# than the replicas that cache them (hashes of ints and tuples of ints are the same in every process).
_ROOT = 0x6B696C6E


def chain_hash(prev: int | None, token_ids: tuple[int, ...], images: tuple[tuple[int, int], ...] = ()) -> int:
    """images: (content key, offset) of each image in the block (Sequence.block_key), so that the same
    placeholder tokens with another image hash apart; a text block hashes as it always has."""
    if images:
        return hash((_ROOT if prev is None else prev, token_ids, images))
    return hash((_ROOT if prev is None else prev, token_ids))


def prompt_block_hashes(token_ids: list[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of a token list, as the block manager names them once cached
    (at most max_blocks of them): what a router compares with a replica's cached blocks."""
    count = len(token_ids) // block_size if max_blocks is None else min(max_blocks, len(token_ids) // block_size)
    hashes: list[int] = []
    prev = None
    for i in range(count):
        prev = chain_hash(prev, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(prev)
    return hashes


def window_tokens(sliding_window: int, chunk: int, block_size: int) -> int:
    """The most tokens' worth of blocks one sequence holds at once with a sliding window, computing at most
    `chunk` tokens a step: the window's blocks and the chunk's, plus one partly filled at the window's start."""
    return (-(-(sliding_window + chunk) // block_size) + 1) * block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int = 0) -> None:
        """sliding_window: every layer's window (0: some layer attends to the whole context; nothing released)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0 = off), got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.hash_to_block: dict[int, int] = {}
        self.owners: dict[int, Sequence] = {}  # seq_id -> sequences holding blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the longest cached prefix of its tokens; returns its length
        in tokens (the caller, the scheduler, records them as computed).

        At least one token is always left to compute, so the step produces logits for it.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        bs = self.block_size
        max_blocks = (len(seq) - 1) // bs
        if not self.enable_prefix_caching:
            return 0
        prev = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, tokens, seq.block_key(i, bs))
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
        if seq.block_table:
            self.owners[seq.seq_id] = seq
        return len(seq.block_table) * bs

    def can_fit(self, seq: Sequence, num_tokens: int) -> int:
        """How many of num_tokens more tokens (beyond those computed) fit in seq's blocks + free ones."""
        capacity = (len(seq.block_table) + len(self.free_ids)) * self.block_size
        return max(0, min(num_tokens, capacity - seq.num_computed_tokens))

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold its first num_tokens tokens; False (and no change but releases behind
        the sliding window) if it can't. Places behind the window get no block: they are RELEASED at once."""
        self.release_outside_window(seq)
        grow = max(self.blocks_needed(num_tokens) - len(seq.block_table), 0)
        behind = min(max(self.num_outside_window(seq.num_computed_tokens) - len(seq.block_table), 0), grow)
        need = grow - behind
        if need > len(self.free_ids):
            return False
        seq.block_table.extend([RELEASED] * behind)
        for _ in range(need):
            block_id, _ = self.free_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not NO_HASH and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]  # evict
            block.hash, block.token_ids, block.ref_count = NO_HASH, (), 1
            seq.block_table.append(block_id)
        if seq.block_table:
            self.owners[seq.seq_id] = seq
        return True

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share parent's full computed blocks with child (a new sample of the same prompt);
        returns how many tokens they hold (the child's computed tokens)."""
        assert not child.block_table and child.token_ids[: len(parent)] == parent.token_ids[: len(child)]
        shared = min(parent.num_computed_tokens, len(child) - 1) // self.block_size
        if RELEASED in parent.block_table[self.num_outside_window(shared * self.block_size):shared]:
            shared = 0  # the parent has moved on past blocks the child's next token still reads
        for block_id in parent.block_table[:shared]:
            if block_id != RELEASED:
                self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:shared]
        child.block_hashes = parent.block_hashes[:shared]
        if shared:
            self.owners[child.seq_id] = child
        return shared * self.block_size

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (tail first into the LRU queue); its K/V is gone, so the caller
        resets its computed count."""
        for block_id in reversed(seq.block_table):
            if block_id != RELEASED:
                self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        self.owners.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll seq back to the blocks its first num_tokens tokens need (rejected speculative tokens):
        the surplus tail blocks go back to the free queue. Their content was never hashed (commit hashes
        only computed blocks), so nothing findable is lost; empty, they are the next to be reused."""
        keep = self.blocks_needed(num_tokens)
        assert keep >= len(seq.block_hashes), (seq, num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is NO_HASH, block  # a speculative tail is private
            block.ref_count = 0
            self.free_ids[block_id] = None
            self.free_ids.move_to_end(block_id, last=False)  # no cached content: reuse these first
        del seq.block_table[keep:]
        if not seq.block_table:
            self.owners.pop(seq.seq_id, None)

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks a step has just filled, making them findable by later prefixes."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens, seq.block_key(i, bs))
            seq.block_hashes.append(h)
            if seq.block_table[i] == RELEASED:  # its K/V never reached this pool (a handoff): nothing to offer
                continue
            block = self.blocks[seq.block_table[i]]
            if self.enable_prefix_caching and h not in self.hash_to_block and block.hash is NO_HASH:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id

    def num_outside_window(self, num_computed: int) -> int:
        """How many leading blocks no token from position num_computed on reads (0 without a sliding window)."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def release_outside_window(self, seq: Sequence) -> int:
        """Give back seq's blocks that no token it has still to compute reads (sliding window); returns how many."""
        table = seq.block_table
        end = min(self.num_outside_window(seq.num_computed_tokens), len(table))
        start = end
        while start > 0 and table[start - 1] != RELEASED:  # the released run is a prefix: walk back to it
            start -= 1
        for i in range(start, end):
            self._release(table[i])
            table[i] = RELEASED
        return end - start

    def forget_cached_blocks(self) -> None:
        """The pools lost their contents: no free block's K/V may be found by a prefix any more. Every sequence
        that held blocks must have been freed first (their K/V is gone with the rest)."""
        assert not self.owners, f"{len(self.owners)} sequences still hold blocks"
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = NO_HASH, ()

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1

    # -- invariants -------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the allocator's invariants (used by tests after every step)."""
        refs = [0] * len(self.blocks)
        for seq in self.owners.values():
            assert seq.block_table, f"{seq} is an owner without blocks"
            assert seq.num_computed_tokens <= min(len(seq), len(seq.block_table) * self.block_size), seq
            assert len(seq.block_table) <= self.blocks_needed(len(seq)), seq
            assert len(seq.block_hashes) <= seq.num_computed_tokens // self.block_size, seq
            released = seq.block_table.count(RELEASED)
            assert RELEASED not in seq.block_table[released:], f"{seq}: released blocks are not a leading run"
            assert released <= self.num_outside_window(seq.num_computed_tokens), f"{seq}: a block in the window is gone"
            for block_id in seq.block_table[released:]:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"{block} has {refs[block.block_id]} owners"
            assert (block.ref_count == 0) == (block.block_id in self.free_ids), block
            if block.hash is not NO_HASH:
                assert len(block.token_ids) == self.block_size, block
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, (h, self.blocks[block_id])
        assert len(self.free_ids) + sum(1 for r in refs if r) == len(self.blocks)
        for seq in self.owners.values():  # a shared block holds the same prefix in every owner
            for i, h in enumerate(seq.block_hashes):
                if seq.block_table[i] != RELEASED:
                    block = self.blocks[seq.block_table[i]]
                    assert block.hash in (NO_HASH, h), (seq, i, block)
