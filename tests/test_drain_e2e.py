"""Drain end to end: a real coordinator over mutual TLS and three ``siteclient start`` sites
with real trainers, in shared-data mode.

Site-2's health probe is slowed by fault injection (a throttled device): the coordinator
drains it automatically as its probe comes in, and its trainers leave at once. Site-1 stalls
in round 1 and an operator drains it with ``coordinator drain`` while it does. Each drained
site hands its unit back, leaves with status 0 and is not admitted again; site-0 trains the
handed-back units (no backup copies otherwise: speculation waits far longer than the job) and
the job finishes with it alone. Every unit is committed exactly once, and site-0 ends on the
coordinator's final theta.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import grpc
import pytest
from coord_harness import run_cli, subprocess_env, wait_until
from test_site_e2e import start_site, start_tls_coordinator, tiny_gpt_job

from coordinator.data.ledger import DataLedger
from coordinator.events.log import read_events
from coordinator.observe.status import status_doc
from wire.identity import Bundle, issue
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e
ROUNDS = 3


def _job() -> dict:
    cfg = tiny_gpt_job("drain-e2e", sites=3)
    cfg["rounds"].update(total=ROUNDS, min_sites=1, max_sites=3)
    cfg["data"] = {"mode": "shared"}
    cfg["speculation"] = {"min_wait_s": 600.0}
    cfg["health"] = {"min_fraction": 0.1}
    return cfg


def _status(coord, ops) -> dict:
    channel = open_channel(coord.address, Bundle.load(ops))
    try:
        reply = pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=10)
    except grpc.RpcError:
        return {}
    finally:
        channel.close()
    return status_doc(reply)


@pytest.mark.slow  # 40 s on 2 cores; drain_core/drain_rpc/drain_site cover the rules fast
def test_drained_sites_hand_back_their_units_and_leave(tmp_path) -> None:
    coord = start_tls_coordinator(tmp_path, _job())
    ops = tmp_path / "pki" / "ops"
    issue(tmp_path / "ca", "operator", "ops", ops)
    env = subprocess_env()
    env["ISTHMUS_FAULTS"] = (
        "site=site-2,round=0,step=0,rank=0,action=slow_probe,seconds=4;"
        "site=site-1,round=1,step=2,rank=0,action=stall,seconds=8"
    )
    sites = [start_site(tmp_path, coord.address, i, env, nproc=1, num_sites=3) for i in range(3)]
    try:
        # Site-1 sits in its stall in round 1: the operator drains it there.
        def stalled():
            doc = _status(coord, ops)
            site = {s["site"]: s for s in doc.get("sites", [])}.get("site-1", {})
            return site.get("progress", {}).get("round") == 1 and doc["round"]["round"] == 1

        wait_until(stalled, timeout=180, interval=0.5, what="site-1 training round 1")
        result = run_cli(
            "drain", "site-1", "--reason", "stalled node", "--coordinator", coord.address,
            "--tls-dir", str(ops),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        codes = [p.wait(timeout=240) for p in sites]
        logs = [(tmp_path / f"site-{i}.log").read_text() for i in range(3)]
        assert codes == [0, 0, 0], f"exit codes {codes}:\n" + "\n".join(x[-2500:] for x in logs)
        assert coord.wait(timeout=60) == 0, coord.log_tail()
    finally:
        for p in sites:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        coord.stop()

    events = list(read_events(tmp_path / "state" / "events.jsonl"))
    drains = {e["site"]: e for e in events if e["kind"] == "drained"}
    assert set(drains) == {"site-1", "site-2"}
    assert drains["site-2"]["by"] == "health" and "matmul" in drains["site-2"]["reason"]
    assert drains["site-1"]["by"] == "operator" and drains["site-1"]["reason"] == "stalled node"
    for i in (1, 2):
        assert f"site site-{i} was drained by the coordinator" in logs[i], logs[i][-2500:]
    # Site-2 left at once; site-1's trainers, out of their stall, may find the job over and
    # take the final theta like any site.
    assert "drained by the coordinator: trainers leave" in logs[2]
    assert not (tmp_path / "site-2" / "final.json").exists()
    # Neither came back: every later round was site-0's alone.
    opened = [e for e in events if e["kind"] == "round_open"]
    assert opened[-1]["sites"] == ["site-0"]
    # Exactly once: every unit committed once, each counted once in the event log.
    meta_path = tmp_path / "state" / "checkpoints" / f"round-{ROUNDS:08d}" / "meta.json"
    meta = json.loads(meta_path.read_text())
    ledger = DataLedger.from_dict(meta["ledger"])
    assert ledger.invariant_violations() == []
    counted = [e["unit"] for e in events if e["kind"] == "update"]
    assert len(counted) == len(set(counted)), counted
    assert all(ledger.committed_by(u) is not None for u in counted)
    # Site-1's unit of round 1 went back and was trained by site-0.
    round1 = {e["unit"]: e["site"] for e in events if e["kind"] == "update" and e["round"] == 1}
    assert set(round1.values()) == {"site-0"}, round1
    final = json.loads((tmp_path / "site-0" / "final.json").read_text())
    assert final["version"] == ROUNDS and final["theta_hash"] == meta["theta_digest"]
