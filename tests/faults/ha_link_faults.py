"""Cut links of a job with standby coordinators (``faults.ha_cluster``): the leader cut off
from etcd while the sites still reach it, and the object store out of reach for 30 s.

* Leader cut off from etcd (``cut_leader_from_etcd``): only the leader's own relay to etcd is
  cut, in the middle of round 1. Its lease can no longer be renewed, so it stops acting at its
  last renewal plus the TTL less its margin, before etcd can elect anyone: it refuses every
  call from then on, steps down and exits ``DEPOSED_EXIT``, and the harness starts it again as
  a standby. The other coordinator is elected once etcd drops the lapsed lease, loads the
  newest committed checkpoint and opens round 1 again. What the sites sent the deposed leader
  of round 1 went with its spool: they send it again.
* Object store out of reach (``cut_store``): the relay between both coordinators and SeaweedFS
  drops everything for 30 s, while round 1 is open or while a checkpoint is being uploaded.
  The leader keeps its etcd lease, so nobody takes over; rounds close from the fsynced spool
  and are published, and the checkpoint writes wait for the store to come back.

Once the job ended, ``check_etcd_cut`` and ``check_store_outage`` add what each fault must also
show (the two coordinators never served at once; one writer, every reported checkpoint
committed, the committed rounds without a hole).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from coordinator.service.server import DEPOSED_EXIT
from faults.ha_cluster import TTL_S, HaCluster
from faults.ha_faults import StandbyRun, checkpoint_uploading, signal_site

ROUND = 1
ETCD_CUT_S = 10.0
STORE_CUT_S = 30.0


@dataclass(frozen=True)
class Cutoff:
    """What was seen of the leader cut off from etcd, in seconds from the cut."""

    stopped_s: float  # it first refused a call
    other_leads_s: float  # the other coordinator first answered as the leader
    exited_s: float  # it exited DEPOSED_EXIT (and was started again)


def cut_leader_from_etcd(c: HaCluster) -> Cutoff:
    """Cut the leader's etcd link for ``ETCD_CUT_S`` while round 1 is open. site-1 is
    stopped (SIGSTOP) once it trains round 1 until the other coordinator leads, so the round
    cannot close (nor the job end, its rounds take about a second) before the leader's lease
    runs out."""
    c.wait_for(lambda: c.sites[1].reached(ROUND, 1), 120, "site-1 in round 1")
    signal_site(c.sites[1], signal.SIGSTOP)
    try:
        leader = c.leader()
        (other,) = [x for x in c.coordinators if x is not leader]
        cut_at = time.monotonic()
        c.fault_at = time.time()
        c.etcd_relay(leader).cut(ETCD_CUT_S)
        c.wait_for(lambda: not c.leads(leader), 4 * TTL_S, "the cut-off leader to stop", 0.05)
        stopped = time.monotonic() - cut_at
        c.wait_for(lambda: c.leads(other), 60, "the other coordinator to lead", 0.05)
        other_leads = time.monotonic() - cut_at
    finally:
        signal_site(c.sites[1], signal.SIGCONT)
    c.wait_for(lambda: c.exits, 30, "the cut-off leader to exit")
    exited = c.exits[0][2] - c.fault_at
    return Cutoff(stopped, other_leads, exited)


def cut_store_while_round_open(c: HaCluster) -> None:
    """The object store is unreachable for ``STORE_CUT_S`` from the middle of round 1, once
    round 1's own checkpoint (round 0's close) is committed: the next one meets the cut."""

    def in_round() -> bool:
        with c.watcher.lock:
            committed = ROUND in c.watcher.manifests
        return committed and c.sites[0].reached(ROUND, 2)

    c.wait_for(in_round, 120, "site-0 in round 1, its checkpoint committed")
    _cut_store(c)


def cut_store_while_checkpointing(c: HaCluster) -> None:
    """The object store is unreachable for ``STORE_CUT_S`` from the moment round 2's
    checkpoint (round 1's close) has data in the store and no manifest yet (its ballast
    makes the upload take a while)."""
    c.wait_for(lambda: checkpoint_uploading(c, ROUND + 1), 180, f"round {ROUND + 1}'s upload", 0.01)
    _cut_store(c)


def _cut_store(c: HaCluster) -> None:
    c.store_relay.cut(STORE_CUT_S)
    c.wait_for(lambda: not c.store_relay.is_cut, STORE_CUT_S + 10, "the store to come back")
    c.fault_at = time.time()  # recovery counts from the store's return


def check_etcd_cut(run: StandbyRun) -> list[str]:
    """The cut-off leader stopped within its lease and before the other led (so the two never
    served at once), exited ``DEPOSED_EXIT`` once, and the other was elected."""
    seen, c = run.seen, run.cluster
    problems = []
    # Renewals go every TTL/3: stopping later than the TTL, it may have served while etcd
    # could already elect the other.
    if not seen.stopped_s < TTL_S:
        problems.append(
            f"the cut-off leader stopped {seen.stopped_s:.1f}s after the cut (TTL {TTL_S}s)"
        )
    if not seen.stopped_s < seen.other_leads_s:
        problems.append(f"two leaders served at once: {seen}")
    if [(a, code) for a, code, _ in c.exits] != [(run.first.address, DEPOSED_EXIT)]:
        problems.append(f"expected one exit {DEPOSED_EXIT} of {run.first.address}, got {c.exits}")
    if "stepping down" not in run.first.log_tail(4000):
        problems.append(f"{run.first.address} never logged 'stepping down'")
    problems += [
        f"{o.address} never logged 'elected leader'"
        for o in run.others
        if "elected leader" not in o.log_tail(4000)
    ]
    return problems


def check_store_outage(run: StandbyRun) -> list[str]:
    """The leader kept its lease (nobody stepped down) and one start committed every round;
    round 2's checkpoint met the outage and was retried; every checkpoint the coordinator
    reported written is committed in the store, and the committed rounds have no hole."""
    c, total = run.cluster, run.cluster.spec.coordinator_rounds
    manifests = c.watcher.manifests
    writers = {epoch for attempts in manifests.values() for epoch in attempts.values()}
    problems = [f"a coordinator exited meanwhile: {c.exits}"] if c.exits else []
    if len(writers) != 1:
        problems.append(f"{len(writers)} starts wrote manifests: {manifests}")
    if f"did not answer while round {ROUND + 1}'s checkpoint" not in run.first.log_tail(4000):
        problems.append(f"round {ROUND + 1}'s checkpoint never waited for the store")
    committed = sorted(manifests)
    reported = {e["round"] for e in run.record.events if e["kind"] == "checkpoint_written"}
    if not reported <= set(committed):
        problems.append(f"reported but never committed: {sorted(reported - set(committed))}")
    if not committed or committed != list(range(committed[0], total + 1)):
        problems.append(f"committed rounds {committed} are not a run up to round {total}")
    return problems
