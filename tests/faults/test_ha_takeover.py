"""Standby coordinators under ``kill -9`` of the leader (``faults.ha_faults``, the rows
``faults.ha_scenarios.TAKEOVER``): two ``serve --ha`` processes on one SeaweedFS and one etcd,
two real sites (one FSDP2 trainer each). The job must keep every invariant of the fault matrix
and end on the crash-free run's model; the standby leads, and the killed leader, restarted,
finds the job complete and exits 0 (``check_takeover``)."""

from __future__ import annotations

import pytest

from faults.ha_scenarios import TAKEOVER
from faults.scenarios import scenario_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("scenario", TAKEOVER, ids=scenario_id)
def test_standby_takes_over_from_a_killed_leader(scenario, survives):
    survives(scenario)
