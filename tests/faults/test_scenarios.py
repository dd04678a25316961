"""The fault matrix against real processes: a coordinator and two ``siteclient start`` agents
(one FSDP2 trainer each), each site behind its own WAN relay.

Every scenario must keep the invariants (``faults.invariants``): the job completes, no round is
lost, nothing is counted twice, every site ends on the coordinator's theta, and where the fault
must not change the model, that theta is the crash-free run's. The quick ones run in
``make test``; the rest are marked slow (``pytest -m slow tests/faults``). The rows with a
standby coordinator are in ``test_ha_takeover.py`` and ``test_ha_links.py``.
"""

from __future__ import annotations

import pytest

from faults.scenarios import SINGLE, Scenario, scenario_id

pytestmark = pytest.mark.e2e


def _param(s: Scenario):
    marks = [pytest.mark.slow] if s.slow else []
    return pytest.param(s, id=scenario_id(s), marks=marks)


@pytest.mark.parametrize("scenario", [_param(s) for s in SINGLE])
def test_job_survives(scenario: Scenario, survives):
    survives(scenario)
