"""What a fault scenario is and how its run is judged, whichever harness it runs on.

A ``Scenario`` is a job spec plus a ``drive`` function that injects its fault into a running
job. Without ``standby`` the job has one coordinator (``faults.cluster.Cluster``); with it,
two ``serve --ha`` coordinators on one etcd and one object store, one leading and one standing
by (``faults.ha_cluster.HaCluster``), and ``Standby.check`` adds what such a fault must also
keep (one leader at a time, one writer per round in the store, ...). Every run is summed up by
``judged``: the invariants of ``faults.invariants`` over its record, where the drive's own
failure and the scenario's extra checks count as problems like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from faults.invariants import Verdict, judge
from faults.record import RunRecord
from faults.spec import JobSpec


@dataclass(frozen=True)
class Standby:
    """A scenario that runs on two coordinators, one standing by (``HaCluster``).

    Attributes
    ----------
    check
        Called with a ``faults.ha_faults.StandbyRun`` once the job ended (its cluster still
        up, so it may restart a coordinator); returns what went wrong, empty if nothing.
    etcd_relays
        Each coordinator reaches etcd through a relay of its own (to cut one off).
    store_relay
        The coordinators reach the object store through one relay (to cut it).
    """

    check: Callable[[Any], list[str]]
    etcd_relays: bool = False
    store_relay: bool = False


@dataclass(frozen=True)
class Scenario:
    """A fault and the job it hits.

    Attributes
    ----------
    drive
        Injects the fault into the running cluster (a ``Cluster``, or a ``HaCluster`` with
        ``standby``); what it returns goes to ``Standby.check``.
    deterministic
        The fault must not change the model: the final theta equals the crash-free run's and
        every round counts every site.
    slow
        Left out of the quick test run (``pytest -m 'not slow'``).
    round_after_fault
        Whether a round must close after the fault (not so when the job ends during a cut).
    standby
        None: one coordinator; else the job runs with a standby coordinator, as this says.
    """

    name: str
    drive: Callable[[Any], object]
    spec: JobSpec = field(default_factory=JobSpec)
    deterministic: bool = True
    slow: bool = True
    faults_env: str = ""
    round_after_fault: bool = True
    standby: Standby | None = None


@dataclass(frozen=True)
class Result:
    scenario: Scenario
    record: RunRecord
    verdict: Verdict
    seconds: float
    error: str | None = None  # the drive function's own failure (a missed window, ...)


def judged(
    scenario: Scenario,
    record: RunRecord,
    reference: str | None,
    seconds: float,
    error: str | None,
    tails: str,
) -> Result:
    """The ``Result`` of one run of ``scenario``: its record judged by the invariants, with
    the drive's ``error`` (if any) as one more problem; ``tails`` (the processes' last log
    lines) go with the problems of a run that failed."""
    if error:
        record.problems.append(f"fault injection: {error}")
    sites = [f"site-{i}" for i in range(scenario.spec.sites)]
    verdict = judge(
        record,
        reference_hash=reference if scenario.deterministic else None,
        all_sites=sites if scenario.deterministic else None,
    )
    if scenario.round_after_fault and verdict.recovery_s is None:
        verdict.problems.append("no round closed after the fault")
        verdict.survived = False
    if not verdict.survived:
        verdict.problems.append(f"logs:\n{tails}")
    return Result(scenario, record, verdict, seconds, error)
