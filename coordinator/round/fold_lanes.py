"""Fold lanes: threads that fold one round's updates side by side, each over its own tensors.

The tensors are dealt to the lanes by the plan that splits them between coordinator shards
(``wire.shard_plan``: whole tensors, largest first, to the lane holding the fewest bytes). Each
lane folds its tensors in the round's fold order, so every tensor of the sum sees the same
additions in the same order whatever the number of lanes: the sum is bit for bit the one a
single lane makes. torch's kernels and the spool's reads release the GIL, so lanes use as many
cores as there are lanes (and tensors to share out).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from wire.shard_plan import MAX_SHARDS, plan_shards

DEFAULT_MAX_LANES = 8


def default_lanes() -> int:
    """One lane per core this process may run on, at most ``DEFAULT_MAX_LANES``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(DEFAULT_MAX_LANES, cores))


@dataclass(frozen=True)
class Lane:
    """One thread and the tensors it folds."""

    worker: ThreadPoolExecutor
    names: frozenset[str]


class FoldLanes:
    """``count`` single-thread workers, kept for the whole job (``shutdown`` at the end)."""

    def __init__(self, count: int) -> None:
        if not 1 <= count <= MAX_SHARDS:
            raise ValueError(f"fold lanes: must be in [1, {MAX_SHARDS}], got {count}")
        self.workers = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fold-lane-{i}")
            for i in range(count)
        ]

    def __len__(self) -> int:
        return len(self.workers)

    def split(self, sizes: Mapping[str, int]) -> list[Lane]:
        """The lanes of one sum over ``sizes`` (name -> bytes): no more lanes than tensors."""
        k = max(1, min(len(self.workers), len(sizes)))
        plan = plan_shards(sizes, k)
        return [Lane(self.workers[i], frozenset(plan.names(i))) for i in range(k)]

    def settle(self) -> None:
        """Wait until every fold submitted so far is done."""
        for f in [w.submit(lambda: None) for w in self.workers]:
            f.result()

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown(wait=True)
