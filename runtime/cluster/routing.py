"""Which replica serves a request: the routing policies of `kiln serve --replicas`, in pure Python.

The Ray Serve request router (router.py) keeps one RoutingPolicy (and its ReplicaTable) and asks
RoutingPolicy.rank for every request; nothing here knows Ray, so the policy is unit-tested on its own
(tests/unit/test_cluster_routing.py).

prefix: a request goes to the replica holding the longest cached prefix of its prompt (compared as the
block manager's chained block hashes), when that prefix is at least `min_match_blocks` blocks; otherwise to
the one of two random replicas that holds fewer prefix blocks (a new prefix goes where it evicts least), and
when the replicas' loads differ by more than `imbalance_threshold` requests, to the less loaded of two
(power of two choices). least-loaded: always the latter. round-robin: in turn.

What a replica holds is known two ways: the snapshot each replica reports (its prefix cache's hashes,
every `record_routing_stats` period), and what this router sent it since (a prompt routed to a replica
will be cached there a moment later; without this, the requests that follow a new system prompt within
one reporting period would scatter). Optimistic entries expire after `optimistic_ttl_s`, by which time
the replica's own snapshot says whether the blocks are still there.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import require

POLICIES = ("prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix"
    min_match_blocks: int = 1  # a cached prefix shorter than this does not pull a request to its replica
    imbalance_threshold: int = 8  # in-flight requests between the busiest and the idlest replica
    optimistic_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        require(self.policy in POLICIES, "routing", f"one of {list(POLICIES)}", self.policy)
        require(self.min_match_blocks >= 1, "min_match_blocks", ">= 1", self.min_match_blocks)
        require(self.imbalance_threshold >= 1, "imbalance_threshold", ">= 1", self.imbalance_threshold)
        require(self.optimistic_ttl_s > 0, "optimistic_ttl_s", "> 0", self.optimistic_ttl_s)


@dataclass
class _Replica:
    reported: frozenset[int] = frozenset()  # the replica's own snapshot of its prefix cache
    routed: dict[int, float] = field(default_factory=dict)  # hash -> when this router sent a prompt with it
    in_flight: int = 0  # requests routed here and not yet completed

    def holds(self, h: int, now: float, ttl: float) -> bool:
        if h in self.reported:
            return True
        sent = self.routed.get(h)
        return sent is not None and now - sent < ttl


class ReplicaTable:
    """The router's view of each replica: its reported prefix blocks, what was routed to it, its load."""

    def __init__(self, optimistic_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._replicas: dict[str, _Replica] = {}
        self._ttl = optimistic_ttl_s
        self._clock = clock

    def __contains__(self, replica: str) -> bool:
        return replica in self._replicas

    def sync(self, replicas: Sequence[str]) -> None:
        """Keep exactly these replicas (new ones start empty; a replaced replica's cache died with it)."""
        live = set(replicas)
        for gone in set(self._replicas) - live:
            del self._replicas[gone]
        for replica in replicas:
            self._replicas.setdefault(replica, _Replica())

    def report(self, replica: str, cached_hashes: frozenset[int]) -> None:
        """A replica's snapshot of its prefix cache; routed entries it does not confirm are kept until they expire."""
        if replica in self._replicas:
            self._replicas[replica].reported = cached_hashes

    def routed(self, replica: str, hashes: Sequence[int]) -> None:
        """A request was sent to the replica: one more in flight there, and its prompt soon cached there."""
        entry = self._replicas.get(replica)
        if entry is None:
            return
        entry.in_flight += 1
        self.expect(replica, hashes)

    def expect(self, replica: str, hashes: Sequence[int]) -> None:
        """The prompt is about to be cached at the replica (chosen, not yet sent): concurrent routing decisions
        see it at once, so a burst of new prefixes spreads instead of all seeing the same empty table."""
        entry = self._replicas.get(replica)
        if entry is None:
            return
        now = self._clock()
        entry.routed.update((h, now) for h in hashes)
        if len(entry.routed) > 4 * max(len(entry.reported), 1024):  # forget expired entries now and then
            entry.routed = {h: t for h, t in entry.routed.items() if now - t < 60.0}

    def completed(self, replica: str) -> None:
        entry = self._replicas.get(replica)
        if entry is not None and entry.in_flight > 0:
            entry.in_flight -= 1

    def load(self, replica: str) -> int:
        return self._replicas[replica].in_flight

    def cached_size(self, replica: str) -> int:
        """How many prefix blocks the replica is believed to hold (reported, or routed there and not expired)."""
        entry, now = self._replicas[replica], self._clock()
        return len(entry.reported) + sum(1 for h, t in entry.routed.items()
                                         if now - t < self._ttl and h not in entry.reported)

    def match(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chained hashes) the replica holds."""
        entry, now = self._replicas[replica], self._clock()
        for i, h in enumerate(hashes):
            if not entry.holds(h, now, self._ttl):
                return i
        return len(hashes)


class RoutingPolicy:
    """Ranks candidate replicas for one request: the first rank is tried first (router.py's contract)."""

    def __init__(self, config: RoutingConfig, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.table = ReplicaTable(config.optimistic_ttl_s, clock)
        self._rng = rng or random.Random()
        self._next = 0  # round-robin position
        self.num_prefix_routed = 0  # requests sent to a replica for its cached prefix
        self.num_balanced = 0  # requests sent by load (no useful match, or imbalance)

    def rank(self, candidates: Sequence[str], hashes: Sequence[int]) -> list[list[str]]:
        """candidates: the replicas that can take a request now; hashes: the prompt's chained block hashes."""
        if not candidates:
            return []
        policy = self.config.policy
        if policy == "round-robin":
            chosen = sorted(candidates)[self._next % len(candidates)]
            self._next += 1
            return [[chosen], [c for c in candidates if c != chosen]]
        if policy == "prefix" and hashes and not self._imbalanced(candidates):
            matches = {c: self.table.match(c, hashes) for c in candidates}
            best = max(matches.values())
            if best >= self.config.min_match_blocks:
                self.num_prefix_routed += 1
                top = sorted((c for c in candidates if matches[c] == best), key=self.table.load)
                return self._expected(top[0], hashes, candidates)
        self.num_balanced += 1
        if policy == "prefix":  # a new prefix: to where it evicts the least (SGLang's cache-aware router does so)
            pair = self._power_of_two(candidates, key=lambda c: (self.table.cached_size(c), self.table.load(c)))
            return self._expected(pair[0][0], hashes, candidates)
        return self._power_of_two(candidates, key=self.table.load)

    def _expected(self, chosen: str, hashes: Sequence[int], candidates: Sequence[str]) -> list[list[str]]:
        """chosen first (its prompt expected there now), the others after it if chosen refuses the request."""
        self.table.expect(chosen, hashes)
        return [[chosen], [c for c in candidates if c != chosen]]

    def _imbalanced(self, candidates: Sequence[str]) -> bool:
        loads = [self.table.load(c) for c in candidates]
        return max(loads) - min(loads) > self.config.imbalance_threshold

    def _power_of_two(self, candidates: Sequence[str], key: Callable[[str], Any]) -> list[list[str]]:
        pair = self._rng.sample(list(candidates), min(2, len(candidates)))
        pair.sort(key=key)
        return [pair, [c for c in candidates if c not in pair]]
