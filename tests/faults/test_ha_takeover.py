"""Standby coordinators under ``kill -9`` of the leader (``faults.ha_faults``): two ``serve --ha``
processes on one SeaweedFS and one etcd, two real sites (one FSDP2 trainer each). The job must
keep every invariant of the fault matrix and end on the crash-free run's model."""

from __future__ import annotations

import pytest

from faults import ha_faults
from faults.ha_cluster import HaCluster
from faults.invariants import judge
from faults.spec import JobSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SPEC = JobSpec()


@pytest.mark.parametrize(
    "drive,spec",
    [
        (ha_faults.kill_leader_while_round_open, SPEC),
        (ha_faults.kill_leader_with_one_update_counted, SPEC),
        (ha_faults.kill_leader_while_checkpointing, JobSpec(ballast_mib=96)),
    ],
    ids=["round-open", "one-update-counted", "checkpointing"],
)
def test_standby_takes_over_from_a_killed_leader(
    drive, spec, reference, etcd, seaweed, monkeypatch, tmp_path
):
    expected = reference(spec)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)  # the coordinators inherit them
    with HaCluster(tmp_path, spec, etcd, seaweed) as c:
        c.start()
        first = c.leader()
        drive(c)
        record = c.finish()
        tails = c.tails()
        second = [x for x in c.coordinators if x is not first]
        # The killed one, restarted as an operator would, is elected (the other resigned at
        # the job's end), finds the job complete in the store and exits at once.
        first.start()
        assert first.wait(timeout=30) == 0, first.log_tail()
        assert "is complete" in first.log_tail(5), first.log_tail()
    sites = [f"site-{i}" for i in range(spec.sites)]
    verdict = judge(record, reference_hash=expected, all_sites=sites)
    assert verdict.survived, "\n".join(verdict.problems) + f"\nlogs:\n{tails}"
    assert verdict.lost_rounds == [] and verdict.double_counted == 0
    assert verdict.recovery_s is not None, "no round closed after the takeover"
    assert "elected leader" in second[0].log_tail(2000), second[0].log_tail(80)
