"""Fixtures of the fault suite: the crash-free reference run, shared by every test of a
session that trains the same model, and the etcd and SeaweedFS of the standby rows."""

from __future__ import annotations

import pytest

from faults.cluster import JobSpec
from faults.ha_scenarios import Servers
from faults.scenarios import reference_hash, run_scenario


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``reference(spec)``: theta_{total} hash of a crash-free run of ``spec``'s model."""

    hashes: dict[tuple, str] = {}

    def get(spec: JobSpec) -> str:
        key = spec.model_key()
        if key not in hashes:
            hashes[key] = reference_hash(spec, tmp_path_factory.mktemp("crash-free"))
        return hashes[key]

    return get


@pytest.fixture
def servers(etcd, seaweed) -> Servers:
    """The session's etcd and SeaweedFS (``tests/conftest.py``; skipped where either binary
    is not installed), for the scenarios with a standby coordinator."""
    return Servers(etcd, seaweed)


@pytest.fixture
def survives(reference, tmp_path, request):
    """``survives(scenario)``: run it on its harness and assert it kept every invariant and
    its own checks, and that a round closed after the fault where one must."""

    def run(scenario):
        expected = reference(scenario.spec) if scenario.deterministic else None
        servers = request.getfixturevalue("servers") if scenario.standby else None
        result = run_scenario(scenario, tmp_path, expected, servers)
        v = result.verdict
        assert v.survived, "\n".join(v.problems)
        assert v.lost_rounds == [] and v.double_counted == 0
        return result

    return run
