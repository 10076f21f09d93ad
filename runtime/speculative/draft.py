"""The draft proposer: a second, cheaper engine (same tokenizer) guesses the next k tokens.

The draft runs in the same runtime with its own paged KV pool and block manager. Each target
sequence has a mirror sequence in the draft whose tokens are exactly those with K/V in the draft's
pool. Before proposing, the mirror is brought in step with the target: the longest common prefix of
the two token lists stays computed, the rest (rejected proposals) is rolled back (blocks freed), and
the target's new tokens are computed in the draft's first pass, which also yields the first guess.
Passes 2..k each compute the previous guess and yield the next, batched over the sequences.

Greedy requests get the draft's argmax (a one-hot proposal); sampled ones a draw from the draft's
filtered distribution (the request's temperature, min_p, top_k, top_p), returned with the
proposal, as rejection sampling needs. The draft's draws use their own Generator (never the
target's stream, so proposal and acceptance draws are independent).
"""

from __future__ import annotations

import numpy as np

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.model_runner import Chunk, ModelRunner, pack_chunks
from kiln.runtime.sampler import filtered_probs
from kiln.runtime.sequence import Sequence
from kiln.runtime.speculative.proposer import NO_PROPOSAL, Proposal, ProposalRequest, Proposer
from kiln.runtime.speculative.verify import draw


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class _Guess:
    """One sequence's proposal being built over the draft's passes."""

    def __init__(self, mirror: Sequence, max_tokens: int) -> None:
        self.mirror = mirror
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.probs: list[np.ndarray] = []


class DraftProposer(Proposer):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.mirrors: dict[int, Sequence] = {}  # target seq_id -> its mirror

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        guesses = {}
        current = {r.seq.seq_id for r in requests}
        for request in requests:
            mirror = self._in_step(request.seq, current)
            if mirror is not None:
                guesses[request.seq.seq_id] = _Guess(mirror, request.max_tokens)
        active = list(guesses.values())
        while active:
            self._pass(active)
            active = [g for g in active if len(g.tokens) < g.max_tokens and self._extend(g)]
        out = []
        for request in requests:
            guess = guesses.get(request.seq.seq_id)
            if guess is None or not guess.tokens:
                out.append(NO_PROPOSAL)
                continue
            probs = None if request.seq.params.greedy else np.stack(guess.probs)
            out.append(Proposal(tuple(guess.tokens), probs))
        return out

    def _in_step(self, seq: Sequence, current: set[int]) -> Sequence | None:
        """seq's mirror with its rejected tail rolled back and seq's new tokens appended (uncomputed);
        None when the draft's pool has no room for them even after dropping the mirrors of sequences
        not speculating this step (they are rebuilt when they speculate again)."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            params = seq.params
            rng = np.random.default_rng(None if params.seed is None else [params.seed, seq.index, 1])
            mirror = Sequence(seq.token_ids, params, index=seq.index, rng=rng)
            self.mirrors[seq.seq_id] = mirror
        else:
            keep = min(common_prefix(mirror.token_ids, seq.token_ids), mirror.num_computed_tokens)
            mirror.num_computed_tokens = keep
            self.block_manager.truncate(mirror, keep)
            mirror.token_ids = mirror.token_ids[:keep] + seq.token_ids[keep:]
        if mirror.num_computed_tokens == len(mirror):  # never: seq has one uncomputed token at least
            mirror.num_computed_tokens -= 1
        if not self.block_manager.allocate(mirror, len(mirror)):
            for seq_id in [i for i in self.mirrors if i not in current]:
                self.block_manager.free(self.mirrors.pop(seq_id))
            if not self.block_manager.allocate(mirror, len(mirror)):
                self.release(seq)
                return None
        return mirror

    def _pass(self, guesses: list[_Guess]) -> None:
        """Compute every mirror's uncomputed tokens; each guess gets the draft's next token."""
        chunks = [Chunk(g.mirror.num_computed_tokens, g.mirror.token_ids[g.mirror.num_computed_tokens:],
                        g.mirror.block_table) for g in guesses]
        logits = self.runner.execute(pack_chunks(chunks, all_rows=False))
        mirrors = [g.mirror for g in guesses]
        for g in guesses:
            g.mirror.num_computed_tokens = len(g.mirror)
        sampled = [i for i, m in enumerate(mirrors) if not m.params.greedy]
        probs = filtered_probs(logits[sampled], [mirrors[i] for i in sampled]) if sampled else None
        for i, g in enumerate(guesses):
            if g.mirror.params.greedy:
                g.tokens.append(int(logits[i].argmax()))
            else:
                assert probs is not None
                q = probs[sampled.index(i)]
                g.tokens.append(draw(q, g.mirror.rng.random()))
                g.probs.append(q)

    def _extend(self, guess: _Guess) -> bool:
        """Append the latest guess to the mirror for the next pass; False if the pool is full."""
        mirror = guess.mirror
        if not self.block_manager.allocate(mirror, len(mirror) + 1):
            return False
        mirror.token_ids.append(guess.tokens[-1])
        return True

    def release(self, seq: Sequence) -> None:
        mirror = self.mirrors.pop(seq.seq_id, None)
        if mirror is not None:
            self.block_manager.free(mirror)

    def close(self) -> None:
        self.runner.close()
