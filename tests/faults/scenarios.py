"""The fault matrix: each scenario (``faults.scenario.Scenario``) is a job spec plus a
``drive`` function that injects its fault into a running job. ``SINGLE`` run on one
coordinator (``Cluster``); the standby rows (``faults.ha_scenarios.STANDBY``) on two, one
leading, and need a real etcd and SeaweedFS (``Servers``). ``SCENARIOS`` is the whole matrix;
``run_scenario`` runs one on its harness and judges it against the invariants (and, for
deterministic ones, against the crash-free run of the same spec, ``reference_hash``).

Used by the tests in this folder and by ``python -m bench.chaos``.
"""

from __future__ import annotations

import time
from pathlib import Path

from faults import coordinator_faults as coord
from faults import link_faults as link
from faults import shard_faults as shard
from faults import site_faults as site
from faults import streaming_faults as streaming
from faults.cluster import Cluster, JobSpec
from faults.ha_scenarios import STANDBY, Servers, run_standby
from faults.invariants import judge
from faults.scenario import Result, Scenario, judged

SINGLE: list[Scenario] = [
    Scenario("site killed while fetching", site.kill_while_fetching),
    Scenario("site killed while training", site.kill_while_training),
    Scenario("site killed while pushing", site.kill_while_pushing),
    Scenario("site killed while idle", site.kill_while_idle),
    Scenario("coordinator killed, round open", coord.kill_while_round_open),
    Scenario("coordinator killed, 1 update spooled", coord.kill_with_one_update_spooled),
    Scenario(
        "coordinator killed while aggregating",
        coord.kill_while_aggregating,
        JobSpec(close_delay_s=2.0, delay_round=coord.ROUND),
    ),
    Scenario(
        "coordinator killed while checkpointing",
        coord.kill_while_checkpointing,
        JobSpec(ballast_mib=96),
    ),
    Scenario(
        "coordinator killed after publishing, before its checkpoint",
        coord.kill_after_publishing,  # in-process: tests/test_close_replay.py
        JobSpec(ballast_mib=256),
    ),
    Scenario(
        "coordinator killed, a spooled update damaged",
        coord.kill_and_damage_a_spooled_update,  # in-process: tests/test_spool_damage.py
    ),
    Scenario(
        "coordinator killed after publishing, an update of the close damaged",
        coord.kill_after_publishing_and_damage,
        JobSpec(ballast_mib=256),
    ),
    Scenario("link cut 30s, lease survives", link.cut_link, JobSpec(lease_ttl_s=60.0)),
    Scenario(
        "link cut 30s, lease expires",
        link.cut_link,
        JobSpec(lease_ttl_s=6.0, heartbeat_s=0.5, deadline_s=8.0),
    ),
    Scenario(
        "link cut 30s, job ends without the site",
        link.cut_link,
        JobSpec(lease_ttl_s=6.0, heartbeat_s=0.5, deadline_s=8.0, min_sites=1, outage_timeout_s=90),
        deterministic=False,
        round_after_fault=False,
    ),
    Scenario("link 10x slower", link.slow_link),
    Scenario(
        "update slower to send than the lease TTL",
        link.push_outlasts_lease,
        JobSpec(lease_ttl_s=4.0, heartbeat_s=0.5),
    ),
    Scenario("chunk corrupted in flight (TLS)", link.corrupt_push),
    Scenario(
        "chunk corrupted in flight (plaintext)",
        link.corrupt_push,
        JobSpec(tls=False),
    ),
    # Tokens from before a coordinator crash are fenced over real gRPC in
    # tests/test_coordinator_e2e.py; this scenario adds a whole job with its trainers.
    Scenario("stale token replayed", link.replay_stale_push),
    Scenario(
        "streaming: site trainer killed while a fragment is in flight",
        streaming.kill_trainer_ahead,  # kill -9 restarts: tests/test_streaming_e2e.py
        streaming.SLOW_CLOSE,
        faults_env=streaming.TRAINER_FAULT,
    ),
    Scenario(
        "streaming: site agent killed while fragments in flight",
        streaming.kill_agent_while_pushing_ahead,
        streaming.STREAMING,
    ),
    Scenario(
        "streaming: coordinator killed with a fragment in flight",
        streaming.kill_coordinator_ahead,
        streaming.STREAMING,
    ),
    # Asynchronous rounds: which round each update lands in depends on timing, so the final
    # theta is not compared with a crash-free run's; nothing lost or counted twice all the same.
    Scenario(
        "async: site killed mid-run",
        streaming.kill_site_async,
        streaming.ASYNC,
        deterministic=False,
        slow=False,
    ),
    Scenario(
        "async: coordinator killed, round open",
        coord.kill_while_round_open,
        streaming.ASYNC,
        deterministic=False,
        slow=False,
    ),
    # A coordinator split over shards: judged against the crash-free one-process run.
    Scenario("shards: shard killed mid-round", shard.kill_shard_mid_round, shard.SHARDED),
    Scenario(
        "shards: lead killed while stepping",
        shard.kill_lead_while_stepping,
        shard.SHARDED_SLOW_CLOSE,
    ),
]

SCENARIOS: list[Scenario] = SINGLE + STANDBY
_references: dict[tuple, str] = {}


def by_name(name: str) -> Scenario:
    (found,) = [s for s in SCENARIOS if s.name == name]
    return found


def scenario_id(s: Scenario) -> str:
    """The scenario's name as a test id."""
    return s.name.replace(" ", "-")


def reference_hash(spec: JobSpec, folder: Path) -> str:
    """theta_{total} of a crash-free run of ``spec`` (run once per model-deciding spec)."""
    key = spec.model_key()
    if key not in _references:
        plain = spec.crash_free()
        with Cluster(folder, plain) as c:
            c.start()
            record = c.finish()
        verdict = judge(record, all_sites=[f"site-{i}" for i in range(plain.sites)])
        assert verdict.survived, f"the crash-free run failed: {verdict.problems}\n{c.tails()}"
        _references[key] = record.final_hash
    return _references[key]


def run_scenario(
    scenario: Scenario,
    folder: Path,
    reference: str | None = None,
    servers: Servers | None = None,
) -> Result:
    """Run ``scenario`` in ``folder`` on its harness; ``reference`` is the crash-free final
    theta hash, ``servers`` the etcd and SeaweedFS a standby scenario runs on."""
    if scenario.standby is None:
        return run_single(scenario, folder, reference)
    if servers is None:
        raise ValueError(f"{scenario.name!r} runs on standby coordinators: it needs Servers")
    return run_standby(scenario, folder, reference, servers)


def run_single(scenario: Scenario, folder: Path, reference: str | None = None) -> Result:
    """Run a one-coordinator ``scenario`` in ``folder`` and judge it."""
    started = time.monotonic()
    error = None
    with Cluster(folder, scenario.spec, scenario.faults_env) as c:
        c.start()
        try:
            scenario.drive(c)
        except Exception as exc:  # judged with the rest: the run still has to finish
            error = f"{type(exc).__name__}: {exc}"
        record = c.finish()
        tails = c.tails()
    return judged(scenario, record, reference, time.monotonic() - started, error, tails)
