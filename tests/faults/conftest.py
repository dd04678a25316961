"""Fixtures of the fault suite: the crash-free reference run, shared by every test of a
session that trains the same model."""

from __future__ import annotations

import pytest

from faults.cluster import JobSpec
from faults.scenarios import reference_hash


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
