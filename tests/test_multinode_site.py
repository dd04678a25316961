"""A site of two hosts: two `siteclient start` processes of one site (node ranks 0 and 1, one
c10d rendezvous), beside an ordinary one-host site, in a real job over mutual TLS.

Node 0's agent holds the site's lease and completes its update; node 1's agent never joins,
fetches theta for its own trainer and pushes its own trainer's shard of the update. The
coordinator counts one update per site per round, and every host ends on the same theta.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from coord_harness import REPO, subprocess_env
from test_site_e2e import ROUNDS, TRAIN, start_site, start_tls_coordinator, tiny_gpt_job

from wire.identity import issue

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(tmp: Path, address: str, node: int, rdzv: str, env: dict, nproc: int = 1):
    """Node ``node`` of site-0 (two hosts, ``nproc`` trainers each), sharing one checkpoint
    folder as hosts of one site share a file system."""
    pki = tmp / "pki" / "site-0"
    if not pki.exists():
        issue(tmp / "ca", "site", "site-0", pki)
    log = open(tmp / f"site-0-node{node}.log", "w")  # noqa: SIM115 - owned by the child
    cmd = [
        sys.executable, "-m", "site_client.cli", "start",
        "--coordinator", address, "--site", "site-0",
        "--run-dir", str(tmp / f"site-0-node{node}"),
        "--checkpoint-dir", str(tmp / "site-0-checkpoints"),
        "--tls-dir", str(pki), "--connect-timeout", "30",
        "--nproc-per-node", str(nproc), "--nnodes", "2", "--node-rank", str(node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "site-0",
        "--", str(TRAIN), "--site-index", "0", "--num-sites", "2",
        "--batch-size", "4", "--eval-batches", "2", "--corpus-bytes", str(1 << 20),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def pushes(run_dir: Path) -> list[dict]:
    lines = (run_dir / "timings.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "push"]


def test_a_site_of_two_hosts_pushes_one_update_in_two_parts(tmp_path):
    coord = start_tls_coordinator(tmp_path, tiny_gpt_job("two-hosts", sites=2))
    env = subprocess_env()
    rdzv = f"127.0.0.1:{free_port()}"
    procs = [start_node(tmp_path, coord.address, k, rdzv, env) for k in (0, 1)]
    procs.append(start_site(tmp_path, coord.address, 1, env, nproc=1))
    names = ["site-0-node0", "site-0-node1", "site-1"]
    try:
        codes = [p.wait(timeout=300) for p in procs]
        logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in names}
        assert codes == [0, 0, 0], f"exit codes {codes}:\n" + "\n".join(logs.values())
        assert coord.wait(timeout=60) == 0, coord.log_tail()
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        coord.stop()

    # One update per site per round: the coordinator saw site-0 once, never "site-0-node1".
    ckpts = tmp_path / "state" / "checkpoints"
    for r in range(1, ROUNDS + 1):
        meta = json.loads((ckpts / f"round-{r:08d}" / "meta.json").read_text())
        assert meta["closed_round"]["sites"] == ["site-0", "site-1"]
    final = json.loads((ckpts / f"round-{ROUNDS:08d}" / "meta.json").read_text())["theta_sha256"]
    assert json.loads((tmp_path / "site-0-node0" / "final.json").read_text())["theta_hash"] == final
    node1_log = (tmp_path / "site-0-node1.log").read_text()
    assert f"theta_{ROUNDS} ({final[:12]})" in node1_log, node1_log[-2000:]
    assert "joined as" not in node1_log  # node 1 never joined: node 0 holds the lease

    # Each host moved its own share: node 0 and node 1 each pushed part of every update, and
    # together about what the one-host site pushed (the same model, the same codec).
    node0, node1 = pushes(tmp_path / "site-0-node0"), pushes(tmp_path / "site-0-node1")
    other = pushes(tmp_path / "site-1")
    assert len(node0) == len(node1) == len(other) == ROUNDS
    for a, b, whole in zip(node0, node1, other, strict=True):
        assert 0 < a["bytes"] < 0.8 * whole["bytes"] and 0 < b["bytes"] < 0.8 * whole["bytes"]
        assert abs(a["bytes"] + b["bytes"] - whole["bytes"]) < 0.1 * whole["bytes"]
