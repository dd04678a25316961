"""Faults of a coordinator split over shards (``[shards] count = 2``): ``kill -9`` of the shard
process while round 1 is open (its parts of round 1 spooled or on their way), and of the lead
inside the outer step of round 1 (the shard may have stepped already, or not). The lead starts
a shard process that exits again; a lead killed with -9 takes its shard processes with it and
starts them anew. Neither may change the model: the final theta is the crash-free
one-process run's.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace

from faults import coordinator_faults as coord
from faults.cluster import Cluster
from faults.spec import JobSpec

ROUND = coord.ROUND
SHARDED = JobSpec(shards=2)
SHARDED_SLOW_CLOSE = replace(SHARDED, close_delay_s=2.0, delay_round=ROUND)


def shard_pid(c: Cluster, index: int = 1) -> int:
    """The pid in shard ``index``'s folder lock (``pid N``)."""
    return int((c.state / "shards" / str(index) / "lock").read_text().split()[1])


def kill_shard_mid_round(c: Cluster) -> None:
    """Killed while both sites train round 1, once site-0 is two steps in: each site then
    pushes its part to a shard that is down, or being started again, and retries."""
    c.wait_trained(c.sites[0], ROUND, 2)
    pid = shard_pid(c)
    c.mark_fault()
    os.kill(pid, signal.SIGKILL)
    c.wait_for(lambda: _alive_other(c, pid), 60, "the lead to start shard 1 again")


def _alive_other(c: Cluster, old: int) -> bool:
    try:
        return shard_pid(c) != old
    except (OSError, ValueError, IndexError):
        return False


def kill_lead_while_stepping(c: Cluster) -> None:
    """The lead killed inside round 1's outer step (its shard processes go with it), then
    started again: it replays round 1's close, and the shard steps once, or answers from its
    record."""
    coord.kill_while_aggregating(c)
