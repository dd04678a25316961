"""Faults of the leading coordinator of a job with a standby (``faults.ha_cluster``): ``kill -9``
of the leader while round 1 is open, before any update of it counted or once one did, and
while it uploads a checkpoint (data in the store, no manifest yet). The
standby is elected when the leader's etcd lease lapses, loads the newest committed checkpoint
from the object store and opens round 1 again; the sites find it by themselves, and a site
whose update the dead leader had counted sends it again (that leader's spool went with it).
"""

from __future__ import annotations

import contextlib
import os
import signal

from coordinator import s3_layout
from coordinator.s3_objects import list_keys
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
    signal_site(c.sites[1], signal.SIGSTOP)
    try:

        def one_in():
            reply, _ = c.status()
            return reply is not None and reply.round.round == ROUND and reply.updates_received == 1

        c.wait_for(one_in, 120, "site-0's round-1 update to count", interval=0.05)
        c.kill_leader()
    finally:
        signal_site(c.sites[1], signal.SIGCONT)


def kill_leader_while_checkpointing(c: HaCluster) -> None:
    """Killed while round 2's checkpoint (round 1's close) has data in the store and no
    manifest yet (the job's ballast makes the upload take a while): the half-written
    checkpoint must never be read, and round 1 closes again under the new leader."""
    c.wait_for(lambda: checkpoint_uploading(c, ROUND + 1), 180, "a checkpoint upload", 0.01)
    c.kill_leader()


def checkpoint_uploading(c: HaCluster, round_number: int) -> bool:
    """Whether round ``round_number``'s checkpoint has data in the store and no manifest."""
    folder = s3_layout.round_folder(round_number)
    keys = list_keys(c.store.client, c.store.bucket, c.store.dir + folder)
    return bool(keys) and s3_layout.MANIFEST not in keys


def signal_site(site, sig: int) -> None:
    """Send ``sig`` to a site's whole process group (its agent and trainers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(site.proc.pid, sig)
