"""Standby coordinators under cut links (``faults.ha_link_faults``, the rows
``faults.ha_scenarios.LINKS``): the leader cut off from etcd while the sites still reach it,
and the object store unreachable for 30 s. Two ``serve --ha`` processes on one SeaweedFS and
one etcd, two real sites (one FSDP2 trainer each); the job must keep every invariant of the
fault matrix, end on the crash-free run's model, and leave one valid commit per round in the
store (``S3Watcher.split_brain``), plus each fault's own checks (``check_etcd_cut``: the leader
stopped within its lease, before the other led, and exited 4; ``check_store_outage``: one
writer, every reported checkpoint committed, the committed rounds without a hole)."""

from __future__ import annotations

import pytest

from faults.ha_scenarios import LINKS
from faults.scenarios import scenario_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("scenario", LINKS, ids=scenario_id)
def test_job_survives_a_cut_link(scenario, survives):
    survives(scenario)
