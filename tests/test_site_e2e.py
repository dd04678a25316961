"""A real job over mutual TLS: a coordinator and two `siteclient start` agents, each with 2
FSDP2 trainers.

One trainer of site-0 is killed with SIGKILL in the middle of round 1 (fault injection keyed
by site, round, step and rank); the elastic launcher restarts the site's trainers, they resume
from the site checkpoint and the round completes with both sites' updates.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from coord_harness import (
    REPO,
    CoordinatorProcess,
    job_config,
    scrape_metrics,
    subprocess_env,
    wait_until,
    write_config,
)

from wire.identity import init_ca, issue

pytestmark = pytest.mark.e2e

TRAIN = REPO / "examples" / "gpt_diloco" / "train.py"
ROUNDS = 3


def start_site(
    tmp: Path,
    address: str,
    index: int,
    env: dict,
    agent_flags: tuple[str, ...] = (),
    nproc: int = 2,
    num_sites: int = 2,
) -> subprocess.Popen:
    site = f"site-{index}"
    issue(tmp / "ca", "site", site, tmp / "pki" / site)
    log = open(tmp / f"{site}.log", "w")  # noqa: SIM115 - owned by the child
    cmd = [
        sys.executable,
        "-m",
        "site_client.cli",
        "start",
        "--coordinator",
        address,
        "--site",
        site,
        "--run-dir",
        str(tmp / site),
        "--tls-dir",
        str(tmp / "pki" / site),
        "--nproc-per-node",
        str(nproc),
        "--connect-timeout",
        "30",
        *agent_flags,
        "--",
        str(TRAIN),
        "--site-index",
        str(index),
        "--num-sites",
        str(num_sites),
        "--batch-size",
        "4",
        "--eval-batches",
        "2",
        "--corpus-bytes",
        str(1 << 20),
        "--checkpoint-every",
        "2",
    ]
    # Its own session: cleanup can kill the agent and its trainers together.
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def tiny_gpt_job(name: str, sites: int) -> dict:
    return job_config(
        name=name,
        strategy={"name": "diloco", "lr": 0.7, "momentum": 0.9},
        model={
            "factory": "examples.gpt_diloco.model:build_model",
            "kwargs": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
        },
        rounds={
            "total": ROUNDS,
            "inner_steps": 8,
            "min_sites": sites,
            "max_sites": sites,
            "join_window_s": 30.0,
            "deadline_s": 300.0,
        },
        timeouts={"heartbeat_interval_s": 0.5, "lease_ttl_s": 30.0},
        # int8 both ways: the sites rebuild each theta from the coordinator's delta.
        compression={"default": "int8", "downlink": {"default": "int8"}},
    )


def start_tls_coordinator(tmp_path: Path, cfg: dict) -> CoordinatorProcess:
    init_ca(tmp_path / "ca", cfg["job"]["name"])
    coord_pki = tmp_path / "pki" / "coord"
    issue(tmp_path / "ca", "coordinator", "coordinator", coord_pki, hosts=("127.0.0.1",))
    coord = CoordinatorProcess(
        write_config(tmp_path, cfg),
        tmp_path / "state",
        tmp_path / "coordinator.log",
        tls_dir=coord_pki,
    )
    coord.start()
    return coord


def final_theta_hash(tmp_path: Path) -> str:
    meta = tmp_path / "state" / "checkpoints" / f"round-{ROUNDS:08d}" / "meta.json"
    return json.loads(meta.read_text())["theta_digest"]


class Scraper(threading.Thread):
    """Scrapes an agent's metrics every half second while it runs; keeps the last scrape."""

    def __init__(self, address_file: Path, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.address_file, self.proc = address_file, proc
        self.last: dict = {}

    def run(self) -> None:
        while self.proc.poll() is None:
            if self.address_file.exists():
                with contextlib.suppress(OSError):
                    self.last = scrape_metrics(self.address_file.read_text().strip())
            time.sleep(0.5)


@pytest.mark.slow  # 32-41 s on 2 cores; test_local, test_multinode_site run FSDP2 sites fast
def test_two_fsdp_sites_survive_a_killed_trainer(tmp_path):
    coord = start_tls_coordinator(tmp_path, tiny_gpt_job("site-e2e", sites=2))
    env = subprocess_env()
    env["ISTHMUS_FAULTS"] = "site=site-0,round=1,step=3,rank=1,action=kill"
    sites = [
        start_site(tmp_path, coord.address, i, env, ("--metrics", "127.0.0.1:0") if i else ())
        for i in range(2)
    ]
    scraped = Scraper(tmp_path / "site-1" / "metrics_address", sites[1])
    try:
        scraped.start()
        codes = [p.wait(timeout=240) for p in sites]
        logs = {i: (tmp_path / f"site-{i}.log").read_text() for i in range(2)}
        assert codes == [0, 0], f"site exit codes {codes}:\n{logs[0][-3000:]}\n{logs[1][-3000:]}"
        assert coord.wait(timeout=60) == 0, coord.log_tail()
    finally:
        for p in sites:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        coord.stop()

    # The killed trainer really died and was restarted by the launcher; the other site's not.
    rank1 = (tmp_path / "site-0" / "trainers" / "rank-1.pid").read_text().split()
    assert rank1[1] == "1", "site-0's trainers were not restarted once"
    assert (tmp_path / "site-1" / "trainers" / "rank-1.pid").read_text().split()[1] == "0"

    # Every round closed with both sites' updates, the interrupted one included.
    ckpts = tmp_path / "state" / "checkpoints"
    for r in range(1, ROUNDS + 1):
        meta = json.loads((ckpts / f"round-{r:08d}" / "meta.json").read_text())
        assert meta["closed_round"]["number"] == r - 1
        assert meta["closed_round"]["sites"] == ["site-0", "site-1"]
    final_meta = json.loads((ckpts / f"round-{ROUNDS:08d}" / "meta.json").read_text())

    # Bit-identical theta: both sites hold the coordinator's final theta.
    for i in range(2):
        final = json.loads((tmp_path / f"site-{i}" / "final.json").read_text())
        assert final["version"] == ROUNDS
        assert final["theta_hash"] == final_meta["theta_digest"]

    # Validation loss of the global model goes down round after round.
    records = [
        json.loads(x) for x in (tmp_path / "site-1" / "metrics.jsonl").read_text().splitlines()
    ]
    val = {r["round"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(val) == list(range(ROUNDS + 1))
    assert val[1] < val[0] and val[ROUNDS] < val[1], val

    # site-1's metrics, as last scraped while it ran, agree with what it did.
    scraped.join(timeout=10)
    m = scraped.last
    assert m, "site-1's metrics were never scraped"
    assert 0 < m[("isthmus_agent_compute_utilisation", ())] <= 1
    trained, waited = (
        m[("isthmus_agent_training_seconds_total", ())],
        m[("isthmus_agent_wan_wait_seconds_total", ())],
    )
    assert trained > 0 and waited >= 0
    assert (
        m[("isthmus_agent_fetches_total", ())] >= 2 and m[("isthmus_agent_pushes_total", ())] >= 1
    )
    assert m[("isthmus_agent_bytes_sent_total", ())] > 0
    assert m[("isthmus_agent_bytes_received_total", ())] > 0
    assert sum(v for (name, _), v in m.items() if name == "isthmus_agent_phase") == 1
    assert ("isthmus_agent_trainer_metric", (("name", "val_loss"),)) in m
    # The trainers' health probe: a matmul on each rank and an all-reduce over the two.
    assert m[("isthmus_agent_matmul_gflops", ())] > 0
    assert m[("isthmus_agent_allreduce_gbps", ())] > 0
    assert m[("isthmus_agent_drained", ())] == 0


@pytest.mark.slow
def test_a_site_rides_out_a_coordinator_outage_longer_than_its_connect_timeout(tmp_path):
    """kill -9 of the coordinator for twice the site's --connect-timeout: the joined site keeps
    retrying (--outage-timeout), re-joins the restarted coordinator and the job completes."""
    coord = start_tls_coordinator(tmp_path, tiny_gpt_job("outage", sites=1))
    flags = ("--connect-timeout", "3")
    site = start_site(tmp_path, coord.address, 0, subprocess_env(), flags)
    try:
        first_close = tmp_path / "state" / "checkpoints" / "round-00000001"
        wait_until(first_close.exists, timeout=120, interval=0.1, what="round 0 to close")
        coord.kill()
        time.sleep(6)
        assert site.poll() is None, "the site gave up during the outage"
        coord.restart()
        assert site.wait(timeout=180) == 0, (tmp_path / "site-0.log").read_text()[-3000:]
        assert coord.wait(timeout=60) == 0, coord.log_tail()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(site.pid, signal.SIGKILL)
        coord.stop()
    final = json.loads((tmp_path / "site-0" / "final.json").read_text())
    assert final["version"] == ROUNDS
    assert final["theta_hash"] == final_theta_hash(tmp_path)
    log = (tmp_path / "site-0.log").read_text()
    assert "heartbeat failed" in log and "re-join" in log  # it retried, then re-joined
