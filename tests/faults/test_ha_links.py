"""Standby coordinators under cut links (``faults.ha_link_faults``): the leader cut off from
etcd while the sites still reach it, and the object store unreachable for 30 s. Two ``serve
--ha`` processes on one SeaweedFS and one etcd, two real sites (one FSDP2 trainer each); the
job must keep every invariant of the fault matrix, end on the crash-free run's model, and
leave one valid commit per round in the store (``S3Watcher.split_brain``)."""

from __future__ import annotations

import pytest

from faults import ha_link_faults as links
from faults.ha_cluster import TTL_S, HaCluster
from faults.invariants import judge
from faults.spec import JobSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SPEC = JobSpec()
SITES = [f"site-{i}" for i in range(SPEC.sites)]


def _judged(record, expected: str, tails: str):
    verdict = judge(record, reference_hash=expected, all_sites=SITES)
    assert verdict.survived, "\n".join(verdict.problems) + f"\nlogs:\n{tails}"
    assert verdict.lost_rounds == [] and verdict.double_counted == 0
    assert verdict.recovery_s is not None, "no round closed after the fault"
    return verdict


def test_leader_cut_off_from_etcd_steps_down(reference, etcd, seaweed, monkeypatch, tmp_path):
    expected = reference(SPEC)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)  # the coordinators inherit them
    with HaCluster(tmp_path, SPEC, etcd, seaweed, etcd_relays=True) as c:
        c.start()
        first = c.leader()
        seen = links.cut_leader_from_etcd(c)
        record = c.finish()
        tails = c.tails()
    _judged(record, expected, tails)
    # It stopped acting before its lease could lapse in etcd (renewals every TTL/3), and
    # before the other one led: the two never served at once.
    assert seen.stopped_s < TTL_S, seen
    assert seen.stopped_s < seen.other_leads_s, seen
    assert [(a, code) for a, code, _ in c.exits] == [(first.address, 4)], c.exits
    assert "stepping down" in first.log_tail(4000), first.log_tail(80)
    (second,) = [x for x in c.coordinators if x is not first]
    assert "elected leader" in second.log_tail(4000), second.log_tail(80)


@pytest.mark.parametrize(
    "drive,spec",
    [
        (links.cut_store_while_round_open, SPEC),
        (links.cut_store_while_checkpointing, JobSpec(ballast_mib=96)),
    ],
    ids=["round-open", "checkpointing"],
)
def test_store_unreachable_for_30s(drive, spec, reference, etcd, seaweed, monkeypatch, tmp_path):
    expected = reference(spec)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    with HaCluster(tmp_path, spec, etcd, seaweed, store_relay=True) as c:
        c.start()
        first = c.leader()
        drive(c)
        record = c.finish()
        tails = c.tails()
        committed = sorted(c.watcher.manifests)
        writers = {e for attempts in c.watcher.manifests.values() for e in attempts.values()}
    _judged(record, expected, tails)
    # The leader kept its etcd lease all along: nobody stepped down, one start committed all.
    assert c.exits == [], c.exits
    assert len(writers) == 1, c.watcher.manifests
    # Round 2's checkpoint met the outage and was tried again until the store answered.
    assert "did not answer while round 2's checkpoint" in first.log_tail(4000), first.log_tail()
    # Every checkpoint the coordinator reported written is committed in the store, and the
    # committed rounds have no hole.
    reported = sorted({e["round"] for e in record.events if e["kind"] == "checkpoint_written"})
    assert set(reported) <= set(committed), (reported, committed)
    assert committed == list(range(committed[0], spec.coordinator_rounds + 1)), committed
