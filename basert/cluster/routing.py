"""Prefix-affinity routing, the decision alone: which replica served a request's prompt prefix most recently.

A prompt is named by the prefix cache's block chain (`prefix_cache.chain_keys`): key i names the prompt's first
16 (i + 1) tokens, so the replica that served the longest run of a request's keys is the one whose cache holds
most of its prompt. `PrefixTable` remembers, per key, the replica that last served it; `rank_replicas` orders
the replicas for one request. Nothing here knows Ray: `basert.cluster.router` feeds it Ray's replicas.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "round-robin")
DEFAULT_TABLE_KEYS = 1_000_000     # about 16 M prompt tokens remembered; 100 MB at most


@dataclass(frozen=True, slots=True)
class Route:
    """What the router needs to know of one request: its prompt's block keys, or the replica asked for."""

    keys: tuple[int, ...] = ()
    replica: int | None = None     # a rank named by the client (?replica=K): that replica or none


class PrefixTable:
    """Block key -> rank of the replica that last served a prompt through that block, oldest forgotten first."""

    def __init__(self, capacity: int = DEFAULT_TABLE_KEYS) -> None:
        if capacity < 1:
            raise ValueError("a prefix table holds at least one key")
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()
        self._held: Counter[int] = Counter()     # replica -> keys it owns

    def __len__(self) -> int:
        return len(self._owner)

    def longest(self, keys: Sequence[int]) -> tuple[int | None, int]:
        """The replica of the longest remembered prefix of `keys`, and how many blocks it covers."""
        for count in range(len(keys), 0, -1):
            owner = self._owner.get(keys[count - 1])
            if owner is not None:
                return owner, count
        return None, 0

    def record(self, keys: Iterable[int], replica: int) -> None:
        """`replica` has just served a prompt through every key of `keys`."""
        for key in keys:
            previous = self._owner.get(key)
            if previous is not None:
                self._held[previous] -= 1
            self._owner[key] = replica
            self._owner.move_to_end(key)
            self._held[replica] += 1
        while len(self._owner) > self.capacity:
            _, owner = self._owner.popitem(last=False)
            self._held[owner] -= 1

    def blocks_of(self, replica: int) -> int:
        """How many remembered keys `replica` owns: what its prefix cache is believed to hold."""
        return self._held[replica]


@dataclass(slots=True)
class RoutingPolicy:
    """Orders replicas for a request: the prefix owner first unless it is overloaded, then the least loaded (ties:
    the one believed to cache less).

    A replica is overloaded when it has at least `overload` requests and `overload` more than the least loaded
    one. The cluster sets `overload` to twice a replica's slots: a full batch running and as many waiting, when
    recomputing the prefix elsewhere becomes cheaper than the wait (a replica batches its slots, so requests up to
    their number cost each other little).
    """

    policy: str = "prefix"
    overload: int = 8
    table: PrefixTable | None = None
    _next: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.overload < 1:
            raise ValueError("overload must be at least 1")
        if self.table is None:
            self.table = PrefixTable()

    def rank_replicas(self, route: Route, loads: Mapping[int, int]) -> list[list[int]]:
        """Ranks to try in order (each inner list one preference level); `loads` maps live ranks to requests
        running there. Empty when the replica a client named is not live."""
        live = sorted(loads)
        if route.replica is not None:
            return [[route.replica]] if route.replica in loads else []
        if not live:
            return []
        # Ties in load go to the replica believed to cache less, so new conversations spread out.
        by_load = sorted(live, key=lambda rank: (loads[rank], self.table.blocks_of(rank), rank))
        if self.policy == "round-robin":
            first = live[self._next % len(live)]
            self._next += 1
        else:
            owner, _ = self.table.longest(route.keys)
            least = by_load[0]
            if owner in loads and not (loads[owner] >= self.overload and loads[owner] - loads[least] >= self.overload):
                first = owner
            else:
                first = least
        return [[first]] + [[rank] for rank in by_load if rank != first]

    def served(self, route: Route, replica: int) -> None:
        """The request went to `replica`: its prefix is now cached there."""
        if self.policy == "prefix":
            self.table.record(route.keys, replica)
