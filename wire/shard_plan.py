"""Which coordinator shard owns which tensors: a pure function both ends compute alike.

A coordinator of K shards (``[shards] count = K``) splits the model's tensors into K sets, one
per shard process (or host), which owns its tensors' theta, outer state, running sum, spool
and checkpoint part. A site pushes each set to its shard and fetches it from there. The plan
is a function of the tensors' names and sizes, K, and (with ``[streaming]``) the fragment each
tensor syncs in, so every party computes the same one from the theta manifest; its digest
travels with the shard map so that a party holding another plan is told so.

Tensors are dealt whole, largest first, each to the shard holding the fewest bytes so far
(ties: the lowest index), within each group: each streaming fragment is balanced on its own,
so every shard takes part in every round and a round's sum is about 1/K of the fragment on
each. A tensor larger than its share is not cut: a shard may then hold more than 1/K
(``imbalance`` says how much); K = 1 is one shard holding everything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_SHARDS = 64


@dataclass(frozen=True)
class ShardPlan:
    """``owner[name]``: the shard index holding tensor ``name``."""

    shards: int
    owner: Mapping[str, int]
    sizes: Mapping[str, int]  # name -> bytes

    def names(self, shard: int) -> tuple[str, ...]:
        """The tensors of ``shard``, sorted."""
        return tuple(sorted(n for n, s in self.owner.items() if s == shard))

    def bytes_of(self, shard: int) -> int:
        return sum(self.sizes[n] for n in self.names(shard))

    def imbalance(self) -> float:
        """The largest shard's bytes over the mean (1.0: even; K when one holds it all)."""
        total = sum(self.sizes.values())
        if not total:
            return 1.0
        return max(self.bytes_of(i) for i in range(self.shards)) * self.shards / total

    def digest(self) -> str:
        """A short hex digest of the assignment (what a party's plan is compared by)."""
        text = json.dumps([self.shards, sorted(self.owner.items())], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def outside(self, name: str, shard: int, addresses: Sequence[str] = ()) -> str | None:
        """Why tensor ``name`` may not go to ``shard``, naming the one it belongs to (None
        when it belongs there)."""
        if name not in self.owner:
            return f"tensor {name!r} is not in the model"
        own = self.owner[name]
        if own == shard:
            return None
        where = f" ({addresses[own]})" if own < len(addresses) and addresses[own] else ""
        return f"tensor {name!r} belongs to shard {own}{where}, not shard {shard}: send it there"


def check_shards(k: int) -> str | None:
    """Why ``k`` shards cannot be, or None."""
    if not 1 <= k <= MAX_SHARDS:
        return f"must be in [1, {MAX_SHARDS}], got {k}"
    return None


def plan_shards(
    sizes: Mapping[str, int], k: int, groups: Mapping[str, int] | None = None
) -> ShardPlan:
    """Deal the tensors ``sizes`` (name -> bytes) to ``k`` shards (see the module docstring);
    ``groups`` (name -> streaming fragment) balances each group on its own.

    Raises
    ------
    ValueError
        ``k`` out of range.
    """
    if problem := check_shards(k):
        raise ValueError(f"shards: {problem}")
    by_group: dict[int, list[str]] = {}
    for name in sizes:
        by_group.setdefault((groups or {}).get(name, -1), []).append(name)
    owner: dict[str, int] = {}
    for group in sorted(by_group):
        load = [0] * k
        for name in sorted(by_group[group], key=lambda n: (-sizes[n], n)):
            i = min(range(k), key=lambda s: (load[s], s))
            owner[name] = i
            load[i] += sizes[name]
    return ShardPlan(k, dict(sorted(owner.items())), dict(sizes))
