"""The fault matrix against real processes: a coordinator and two ``siteclient start`` agents
(one FSDP2 trainer each), each site behind its own WAN relay.

Every scenario must keep the invariants (``faults.invariants``): the job completes, no round is
lost, nothing is counted twice, every site ends on the coordinator's theta, and where the fault
must not change the model, that theta is the crash-free run's. The quick ones run in
``make test``; the rest are marked slow (``pytest -m slow tests/faults``).
"""

from __future__ import annotations

import pytest

from faults.scenarios import SCENARIOS, Scenario, run_scenario

pytestmark = pytest.mark.e2e


def _param(s: Scenario):
    marks = [pytest.mark.slow] if s.slow else []
    return pytest.param(s, id=s.name.replace(" ", "-"), marks=marks)


@pytest.mark.parametrize("scenario", [_param(s) for s in SCENARIOS])
def test_job_survives(scenario: Scenario, reference, tmp_path):
    expected = reference(scenario.spec) if scenario.deterministic else None
    result = run_scenario(scenario, tmp_path, expected)
    v = result.verdict
    assert v.survived, "\n".join(v.problems)
    assert v.lost_rounds == [] and v.double_counted == 0
    if scenario.round_after_fault:
        assert v.recovery_s is not None, "no round closed after the fault"
