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
import time
from pathlib import Path

import pytest
from coord_harness import REPO, subprocess_env, wait_until
from test_site_e2e import ROUNDS, TRAIN, start_site, start_tls_coordinator, tiny_gpt_job

from wire.identity import issue

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(
    tmp: Path, address: str, node: int, rdzv: str, env: dict, nproc: int = 1, site: str = "site-0"
):
    """Node ``node`` of ``site`` (two hosts, ``nproc`` trainers each), sharing one checkpoint
    folder as hosts of one site share a file system."""
    pki = tmp / "pki" / site
    if not pki.exists():
        issue(tmp / "ca", "site", site, pki)
    log = open(tmp / f"{site}-node{node}.log", "a")  # noqa: SIM115 - owned by the child
    cmd = [
        sys.executable, "-m", "site_client.cli", "start",
        "--coordinator", address, "--site", site,
        "--run-dir", str(tmp / f"{site}-node{node}"),
        "--checkpoint-dir", str(tmp / f"{site}-checkpoints"),
        "--tls-dir", str(pki), "--connect-timeout", "30",
        "--nproc-per-node", str(nproc), "--nnodes", "2", "--node-rank", str(node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", site,
        "--", str(TRAIN), "--site-index", site[-1], "--num-sites", "2",
        "--batch-size", "4", "--eval-batches", "2", "--corpus-bytes", str(1 << 20),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def every_round_closed_with_both_sites(tmp: Path) -> str:
    """Assert each round closed with one update of each site; the final theta's hash."""
    ckpts = tmp / "state" / "checkpoints"
    for r in range(1, ROUNDS + 1):
        meta = json.loads((ckpts / f"round-{r:08d}" / "meta.json").read_text())
        assert meta["closed_round"]["sites"] == ["site-0", "site-1"]
    return json.loads((ckpts / f"round-{ROUNDS:08d}" / "meta.json").read_text())["theta_digest"]


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
    final = every_round_closed_with_both_sites(tmp_path)
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


@pytest.mark.slow
def test_two_sites_of_two_hosts_survive_a_killed_node_agent(tmp_path):
    """2 sites x 2 hosts x 2 trainers; kill -9 of site-0's node 1 (its agent and trainers) in
    round 1, started again as an operator would: node 0's trainers restart with it through
    the rendezvous, resume from the shared checkpoint, and every round closes with both sites."""
    coord = start_tls_coordinator(tmp_path, tiny_gpt_job("two-by-two", sites=2))
    env = subprocess_env()
    ends = {s: f"127.0.0.1:{free_port()}" for s in ("site-0", "site-1")}
    procs = {}
    for site in ends:
        for k in (0, 1):  # node 0 first: it hosts the rendezvous store
            procs[site, k] = start_node(tmp_path, coord.address, k, ends[site], env, 2, site)
            time.sleep(1.0)
    try:
        first_close = tmp_path / "state" / "checkpoints" / "round-00000001"
        wait_until(first_close.exists, timeout=240, interval=0.1, what="round 0 to close")
        time.sleep(1.0)  # into round 1's steps
        os.killpg(procs["site-0", 1].pid, signal.SIGKILL)
        procs["site-0", 1].wait(timeout=30)
        procs["site-0", 1] = start_node(tmp_path, coord.address, 1, ends["site-0"], env, 2)
        codes = {key: p.wait(timeout=600) for key, p in procs.items()}
        tails = {k: _log(tmp_path, *k)[-2500:] for k in procs}
        assert set(codes.values()) == {0}, f"exit codes {codes}:\n" + "\n".join(tails.values())
        assert coord.wait(timeout=60) == 0, coord.log_tail()
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        coord.stop()
    final = every_round_closed_with_both_sites(tmp_path)
    for site in ends:
        done = json.loads((tmp_path / f"{site}-node0" / "final.json").read_text())
        assert done["theta_hash"] == final
    # Node 0's trainers were restarted by the launcher once the other host's went.
    rank0 = (tmp_path / "site-0-node0" / "trainers").glob("rank-*.pid")
    assert any(p.read_text().split()[1] != "0" for p in rank0)


def _log(tmp: Path, site: str, node: int) -> str:
    return (tmp / f"{site}-node{node}.log").read_text()
