"""Shared-data mode end to end: a real coordinator, two ``siteclient start`` agents with two
FSDP2 trainers each, training data units of one shared stream.

Site-1 stalls in round 1 (fault injection). Site-0, done with its own unit, is given a backup
copy of site-1's, trains it from the same theta_1 and commits it first; site-1 learns that
its copy lost (a cancel, or round 2 opening), stops its trainers and sends nothing for it.
The job completes with every site holding the coordinator's final theta.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal

import pytest
from coord_harness import subprocess_env
from test_site_e2e import ROUNDS, final_theta_hash, start_site, start_tls_coordinator, tiny_gpt_job

from coordinator.data.ledger import DataLedger
from coordinator.events.log import read_events

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_a_stalled_sites_unit_is_backed_up_and_its_copy_cancelled(tmp_path) -> None:
    cfg = tiny_gpt_job("shared-e2e", sites=2)
    cfg["data"] = {"mode": "shared"}
    cfg["speculation"] = {"min_wait_s": 0.5, "slow_factor": 1.5}
    coord = start_tls_coordinator(tmp_path, cfg)
    env = subprocess_env()
    env["ISTHMUS_FAULTS"] = "site=site-1,round=1,step=2,rank=0,action=stall,seconds=15"
    sites = [start_site(tmp_path, coord.address, i, env) for i in range(2)]
    try:
        codes = [p.wait(timeout=240) for p in sites]
        logs = [(tmp_path / f"site-{i}.log").read_text() for i in range(2)]
        assert codes == [0, 0], f"site exit codes {codes}:\n{logs[0][-3000:]}\n{logs[1][-3000:]}"
        assert coord.wait(timeout=60) == 0, coord.log_tail()
    finally:
        for p in sites:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        coord.stop()

    # Site-0 pushed two units in round 1: its own and the backup copy of site-1's.
    pushed = {i: re.findall(r"round 1 unit (u\d+): pushed", logs[i]) for i in range(2)}
    assert len(pushed[0]) == 2, logs[0][-3000:]
    # Site-1 abandoned its unit of round 1 (told by a cancel, or by round 2 opening once the
    # backup copy closed round 1) and never sent it.
    stopped = re.findall(r"stopping the trainers on round 1 unit (u\d+)", logs[1])
    assert stopped and stopped[0] in pushed[0], logs[1][-3000:]
    assert stopped[0] not in pushed[1]
    # Bit-identical final theta everywhere.
    for i in range(2):
        final = json.loads((tmp_path / f"site-{i}" / "final.json").read_text())
        assert final["version"] == ROUNDS and final["theta_hash"] == final_theta_hash(tmp_path)
    # Exactly once: the coordinator's ledger committed 2 units per round, each in one round,
    # by one site, and its event log counted each unit once.
    ckpts = tmp_path / "state" / "checkpoints"
    meta = json.loads((ckpts / f"round-{ROUNDS:08d}" / "meta.json").read_text())
    ledger = DataLedger.from_dict(meta["ledger"])
    assert ledger.invariant_violations() == []
    units = [f"u{k}" for k in range(2 * ROUNDS)]
    assert all(ledger.committed_by(u) is not None for u in units)
    assert ledger.committed_by(stopped[0])[1] == "site-0"
    counted = [
        e["unit"] for e in read_events(tmp_path / "state" / "events.jsonl") if e["kind"] == "update"
    ]
    assert sorted(counted, key=lambda u: int(u[1:])) == units
