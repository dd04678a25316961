"""Faults of the leading coordinator of a job with a standby (``faults.ha_cluster``): ``kill -9``
of the leader while round 1 is open, before any update of it counted or once one did. The
standby is elected when the leader's etcd lease lapses, loads the newest committed checkpoint
from the object store and opens round 1 again; the sites find it by themselves, and a site
whose update the dead leader had counted sends it again (that leader's spool went with it).
"""

from __future__ import annotations

import contextlib
import os
import signal

from faults.ha_cluster import HaCluster

ROUND = 1


def kill_leader_while_round_open(c: HaCluster) -> None:
    """Killed while both sites train round 1 (nothing counted yet in it)."""
    c.wait_for(lambda: c.sites[0].reached(ROUND, 2), 120, "site-0 in round 1")
    c.kill_leader()


def kill_leader_with_one_update_counted(c: HaCluster) -> None:
    """Killed once site-0's round-1 update counted and site-1's is still due: site-1 is
    stopped (SIGSTOP) meanwhile, so the window cannot be missed."""
    c.wait_for(lambda: c.sites[1].reached(ROUND, 1), 120, "site-1 in round 1")
    _signal(c.sites[1], signal.SIGSTOP)
    try:

        def one_in():
            reply, _ = c.status()
            return reply is not None and reply.round.round == ROUND and reply.updates_received == 1

        c.wait_for(one_in, 120, "site-0's round-1 update to count", interval=0.05)
        c.kill_leader()
    finally:
        _signal(c.sites[1], signal.SIGCONT)


def _signal(site, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(site.proc.pid, sig)
