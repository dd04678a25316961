"""One real job for ``python -m bench.dataplane``: a ``coordinator serve`` and N
``siteclient start`` sites over mutual TLS on loopback, their threads' CPU sampled, and the
windows each phase took read back from the job's own records (the agents' ``timings.jsonl``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.dataplane.sampler import Sampler
from bench.sync_run import _wait_address, job_config

REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "bench" / "sync_trainer.py"
GB = 1e9


@dataclass(eq=False)
class Phase:
    """CPU seconds and bytes of one phase, summed over its windows."""

    bytes: int = 0
    seconds: float = 0.0  # wall time of the windows
    coordinator: float = 0.0
    agents: float = 0.0
    coordinator_groups: dict[str, float] = field(default_factory=dict)

    def add_groups(self, groups: dict[str, float]) -> None:
        for name, seconds in groups.items():
            self.coordinator_groups[name] = self.coordinator_groups.get(name, 0.0) + seconds


@dataclass
class JobRun:
    push: Phase
    close: Phase
    fetch: Phase
    checkpoint_s: float  # the coordinator's checkpoint thread, over the measured rounds
    model_bytes: int
    rounds: int


def make_pki(folder: Path, sites: int) -> None:
    from wire.identity import init_ca, issue

    init_ca(folder / "ca", "dataplane-bench")
    issue(folder / "ca", "coordinator", "coordinator", folder / "coord", hosts=("127.0.0.1",))
    for i in range(sites):
        issue(folder / "ca", "site", f"site-{i}", folder / f"site-{i}")


def env() -> dict[str, str]:
    import os

    inject = REPO / "bench" / "dataplane" / "inject"  # native thread names (sitecustomize)
    out = dict(os.environ, PYTHONPATH=f"{inject}:{REPO}", PYTHONUNBUFFERED="1")
    out.update(FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", OMP_NUM_THREADS="1")
    return out


def run_job(
    folder: Path,
    width: int,
    depth: int,
    sites: int,
    rounds: int,
    codec: str,
    sampler: Sampler,
    warm_up: int = 1,
    timeout_s: float = 1800.0,
) -> JobRun:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    make_pki(folder, sites)
    timeouts = {"heartbeat_interval_s": 5.0, "lease_ttl_s": 60.0}
    (folder / "job.toml").write_text(job_config(width, depth, rounds, 4, codec, timeouts, sites))
    logs = [open(folder / "coordinator.log", "w")]  # noqa: SIM115 - the children's
    cmd = [sys.executable, "-m", "coordinator.cli", "serve", "--config", str(folder / "job.toml")]
    coord = subprocess.Popen(
        [*cmd, "--tls-dir", str(folder / "coord")],
        cwd=REPO,
        env=env(),
        stdout=logs[0],
        stderr=subprocess.STDOUT,
    )
    procs = [coord]
    try:
        sampler.watch("coordinator", coord.pid)
        address = _wait_address(folder / "state" / "address", coord)
        for i in range(sites):
            logs.append(open(folder / f"site-{i}.log", "w"))  # noqa: SIM115
            site = subprocess.Popen(
                _site_cmd(folder, i, address),
                cwd=REPO,
                env=env(),
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
            )
            procs.append(site)
            sampler.watch(f"agent-{i}", site.pid)
        deadline = time.monotonic() + timeout_s
        for p in procs[1:]:
            if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"a site failed; see {folder}")
        coord.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    model_bytes = width * width * depth * 4 + width * depth * 4
    return measure(folder, sites, model_bytes, sampler, warm_up)


def _site_cmd(folder: Path, i: int, address: str) -> list[str]:
    cmd = [sys.executable, "-m", "site_client.cli", "start", "--coordinator", address]
    cmd += ["--site", f"site-{i}", "--tls-dir", str(folder / f"site-{i}")]
    return [
        *cmd,
        "--run-dir",
        str(folder / f"run-{i}"),
        "--nproc-per-node",
        "1",
        "--",
        str(TRAINER),
    ]


def transfers(folder: Path, sites: int, kind: str) -> list[dict]:
    """The agents' records of one kind, each with its site and window."""
    out = []
    for i in range(sites):
        path = folder / f"run-{i}" / "timings.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            t = json.loads(line)
            if t["kind"] == kind:
                out.append({**t, "site": i, "start": t["wall"] - t["s"], "end": t["wall"]})
    return out


def measure(
    folder: Path, sites: int, model_bytes: int, sampler: Sampler, warm_up: int = 1
) -> JobRun:
    """Split the sampled CPU by phase, rounds after the first ``warm_up`` only."""
    pushes = [t for t in transfers(folder, sites, "push") if t["round"] >= warm_up]
    fetches = [t for t in transfers(folder, sites, "fetch") if t["version"] >= warm_up + 1]
    push, close, fetch = Phase(), Phase(), Phase()
    rounds = sorted({t["round"] for t in pushes})
    for r in rounds:
        ups = [t for t in pushes if t["round"] == r]
        downs = [t for t in fetches if t["version"] == r + 1]
        if len(ups) != sites or len(downs) != sites:
            continue  # the last round's theta is fetched as the job's final model, or a retry
        windows = [
            (push, min(t["start"] for t in ups), max(t["end"] for t in ups), ups),
            (close, max(t["end"] for t in ups), min(t["start"] for t in downs), []),
            (fetch, min(t["start"] for t in downs), max(t["end"] for t in downs), downs),
        ]
        for phase, start, end, moved in windows:
            phase.bytes += sum(t["bytes"] for t in moved)
            phase.seconds += max(0.0, end - start)
            groups = sampler.by_group("coordinator", start, end)
            groups.pop("checkpoint", None)  # in the background: shown on its own
            phase.coordinator += sum(groups.values())
            phase.add_groups(groups)
            for t in moved:
                phase.agents += sampler.cpu(f"agent-{t['site']}", t["start"], t["end"])
    first = min((t["start"] for t in pushes), default=0.0)
    last = max((t["end"] for t in fetches), default=0.0)
    checkpoint = sampler.cpu("coordinator", first, last, "checkpoint")
    return JobRun(push, close, fetch, checkpoint, model_bytes, len(rounds))
