"""Faults of the leading coordinator of a job with a standby (``faults.ha_cluster``): ``kill -9``
of the leader while round 1 is open, before any update of it counted or once one did, and
while it uploads a checkpoint (data in the store, no manifest yet). The
standby is elected when the leader's etcd lease lapses, loads the newest committed checkpoint
from the object store and opens round 1 again; the sites find it by themselves, and a site
whose update the dead leader had counted sends it again (that leader's spool went with it).

Once the job ended, ``check_takeover`` adds what a takeover must also show: the standby said it
was elected, and the killed leader, restarted as an operator would, is elected in turn (the
other resigned at the job's end), finds the job complete in the store and exits 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass

from coord_harness import CoordinatorProcess

from coordinator.persist import s3_layout
from faults.ha_cluster import HaCluster
from faults.record import RunRecord
from wire.objstore.objects import list_keys

ROUND = 1
RESTART_S = 30.0  # a restarted coordinator that finds the job complete exits within this


@dataclass(frozen=True)
class StandbyRun:
    """What a standby scenario's checks look at once its job ended (the cluster still up).

    Attributes
    ----------
    first
        The coordinator that led when the fault was injected.
    seen
        What the scenario's drive function returned.
    """

    cluster: HaCluster
    first: CoordinatorProcess
    seen: object
    record: RunRecord

    @property
    def others(self) -> list[CoordinatorProcess]:
        return [c for c in self.cluster.coordinators if c is not self.first]


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


def check_takeover(run: StandbyRun) -> list[str]:
    """The standby led after the kill; the killed leader, started again, exits 0 at once."""
    problems = [
        f"coordinator {c.address} never logged 'elected leader'"
        for c in run.others
        if "elected leader" not in c.log_tail(2000)
    ]
    run.first.start()
    try:
        code = run.first.wait(timeout=RESTART_S)
    except subprocess.TimeoutExpired:
        run.first.kill()
        return [*problems, f"the restarted leader {run.first.address} did not exit"]
    if code != 0 or "is complete" not in run.first.log_tail(5):
        problems.append(
            f"the restarted leader exited {code}, not 0 finding the job complete:\n"
            + run.first.log_tail(20)
        )
    return problems
