"""The routing policies of `kiln serve --replicas` (runtime/cluster/routing.py), without Ray: each test drives a
ReplicaTable and RoutingPolicy as router.py does (routed / reported / completed) and checks where requests go."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kiln.errors import InvalidParamError
from kiln.runtime.block_manager import chain_hash, prompt_block_hashes
from kiln.runtime.cluster.routing import RoutingConfig, RoutingPolicy

REPLICAS = ["a", "b", "c"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def policy(name="prefix", replicas=REPLICAS, clock=None, **kw) -> RoutingPolicy:
    p = RoutingPolicy(RoutingConfig(name, **kw), random.Random(0), clock or Clock())
    p.table.sync(replicas)
    return p


def route(p: RoutingPolicy, hashes, candidates=REPLICAS) -> str:
    chosen = p.rank(candidates, hashes)[0][0]
    p.table.routed(chosen, hashes)
    return chosen


def test_prompt_block_hashes_are_the_block_managers_chain():
    ids = list(range(1, 40))
    h = prompt_block_hashes(ids, 16)
    assert h == [chain_hash(None, tuple(ids[:16])), chain_hash(h[0], tuple(ids[16:32]))]
    assert prompt_block_hashes(ids, 16, max_blocks=1) == h[:1] and prompt_block_hashes(ids[:15], 16) == []


def test_a_reported_prefix_pulls_its_requests_and_the_longest_match_wins():
    p = policy()
    shared = prompt_block_hashes(list(range(64)), 16)
    p.table.report("b", frozenset(shared[:2]))
    p.table.report("c", frozenset(shared))
    assert route(p, shared) == "c"
    assert route(p, shared[:2] + [12345]) in ("b", "c")  # both hold the 2 matching blocks: the less loaded
    assert route(p, shared[:2] + [12345]) == "b"
    assert p.num_prefix_routed == 3 and p.num_balanced == 0


def test_requests_follow_a_new_prefix_before_any_report():
    """What was routed counts as cached for optimistic_ttl_s: a burst after a new system prompt stays together."""
    clock = Clock()
    p = policy(clock=clock, optimistic_ttl_s=5.0)
    prompt = prompt_block_hashes(list(range(100, 164)), 16)
    first = route(p, prompt)
    assert all(route(p, prompt) == first for _ in range(5))
    clock.now = 10.0  # expired, and no replica reported it: balanced again
    p.table.report(first, frozenset())
    for r in REPLICAS:
        while p.table.load(r):
            p.table.completed(r)
    assert {route(p, prompt) for _ in range(12)} == set(REPLICAS)


def test_load_wins_when_replicas_are_imbalanced():
    p = policy(imbalance_threshold=3)
    prompt = prompt_block_hashes(list(range(64)), 16)
    p.table.report("a", frozenset(prompt))
    assert [route(p, prompt) for _ in range(4)] == ["a"] * 4  # a: 4 in flight, the others 0: > 3 apart
    assert route(p, prompt) != "a" and p.num_balanced == 1


def test_a_short_match_does_not_pull():
    p = policy(min_match_blocks=2)
    prompt = prompt_block_hashes(list(range(64)), 16)
    p.table.report("a", frozenset(prompt[:1]))
    for i in range(3):
        route(p, prompt[:1] + [i])
    assert p.num_prefix_routed == 0 and p.num_balanced == 3


def test_least_loaded_and_round_robin():
    p = policy("least-loaded")
    for _ in range(30):
        route(p, [])
    assert max(map(p.table.load, REPLICAS)) - min(map(p.table.load, REPLICAS)) <= 2
    rr = policy("round-robin")
    assert [route(rr, [1, 2]) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_only_candidates_are_ranked_and_replaced_replicas_start_empty():
    p = policy()
    prompt = prompt_block_hashes(list(range(64)), 16)
    p.table.report("a", frozenset(prompt))
    assert route(p, prompt, candidates=["b", "c"]) in ("b", "c")  # a is at max_ongoing_requests: not offered
    p.table.sync(["b", "c", "d"])  # a died; d replaced it
    assert "a" not in p.table and p.table.match("d", prompt) == 0
    assert p.rank([], prompt) == []


def test_bad_config_is_named():
    with pytest.raises(InvalidParamError, match="routing must be one of"):
        RoutingConfig("random")
    with pytest.raises(InvalidParamError, match="imbalance_threshold must be >= 1"):
        RoutingConfig(imbalance_threshold=0)


class LruCache:
    """A replica's prefix cache in the small: block hashes, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.blocks = capacity, OrderedDict()

    def serve(self, hashes: list[int]) -> int:
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks:
            hit += 1
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


@pytest.mark.parametrize("name, low, high", [("prefix", 0.9, 1.0), ("round-robin", 0.0, 0.7)])
def test_shared_system_prompts_hit_rate(name, low, high):
    """8 system prompts x 16 questions, in random order, 6 in flight, on 2 replicas whose caches hold 28 blocks
    (7 system prompts' worth, questions included): prefix routing keeps each system prompt on one replica (near
    the ideal hit rate); round-robin needs all 8 on each and thrashes."""
    p = policy(name, replicas=["a", "b"])
    caches = {"a": LruCache(28), "b": LruCache(28)}
    systems = [[1000 * s + j for j in range(64)] for s in range(8)]  # 4 blocks each
    order = [(s, q) for q in range(16) for s in range(8)]
    random.Random(1).shuffle(order)
    hits = ideal = 0
    seen: set[int] = set()
    in_flight: list[str] = []
    for s, q in order:
        hashes = prompt_block_hashes(systems[s] + [q] * 16, 16)  # + one block of question
        replica = route(p, hashes, ["a", "b"])
        hits += caches[replica].serve(hashes)
        ideal += 4 if s in seen else 0
        seen.add(s)
        p.table.report(replica, frozenset(caches[replica].blocks))
        in_flight.append(replica)
        if len(in_flight) > 6:
            p.table.completed(in_flight.pop(0))
    assert low <= hits / ideal <= high


def test_a_burst_of_new_prefixes_spreads_before_any_is_sent():
    """Serve ranks several pending requests before it sends any: each choice counts at once."""
    p = policy(replicas=["a", "b"])
    firsts = [p.rank(["a", "b"], prompt_block_hashes([100 * s + j for j in range(64)], 16))[0][0] for s in range(8)]
    assert sorted(firsts) == ["a"] * 4 + ["b"] * 4
