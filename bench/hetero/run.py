"""One run of ``python -m bench.hetero``: the job on three sites behind their relays, the
kill of a ``-kill`` run, every checkpointed theta kept as it appears and evaluated after."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))  # the cluster harness lives with the fault tests

from faults.cluster import Cluster  # noqa: E402

from bench.hetero.plan import KILLED, SLOW_SITE, Plan, spec_of  # noqa: E402
from bench.hetero.report import (  # noqa: E402
    RunResult,
    counted_by_site,
    counted_by_version,
    points_of,
    steps_records,
    tokens_trained,
)
from bench.utilisation_report import SiteUse, read_jsonl  # noqa: E402


class ThetaKeeper(threading.Thread):
    """Hard-links each checkpointed theta as it appears (the store keeps only the newest few)
    and notes when it was written."""

    def __init__(self, checkpoints: Path, keep: Path) -> None:
        super().__init__(name="theta-keeper", daemon=True)
        self.checkpoints, self.keep = checkpoints, keep
        self.written: dict[int, float] = {}
        self.stopped = threading.Event()
        keep.mkdir(parents=True, exist_ok=True)

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            self.scan()

    def scan(self) -> None:
        for folder in sorted(self.checkpoints.glob("round-*")):
            version = int(folder.name.removeprefix("round-"))
            if version in self.written:
                continue
            with contextlib.suppress(OSError):  # pruned while we looked
                os.link(folder / "theta.safetensors", self.keep / f"theta-{version}.safetensors")
                self.written[version] = (folder / "meta.json").stat().st_mtime


def evaluate_kept(keep: Path, model_kwargs: dict) -> dict[int, float]:
    """The validation loss of every kept theta, by version."""
    from safetensors.torch import load_file

    from examples.gpt_diloco.evaluate import val_loss
    from examples.gpt_diloco.model import build_model

    model = build_model(**model_kwargs)
    out = {}
    for path in sorted(keep.glob("theta-*.safetensors")):
        version = int(path.stem.removeprefix("theta-"))
        model.load_state_dict(load_file(str(path)), strict=False)
        out[version] = val_loss(model, version)["val_loss"]
    return out


def kill_halfway(cluster: Cluster, plan: Plan, rounds: int, until: float) -> None:
    """Once half the coordinator rounds closed, kill -9 site ``KILLED`` (agent and trainers)
    and start it again ``plan.down_s`` later, on the same run dir."""
    cluster.wait_for(
        lambda: max(cluster.watcher.closed_rounds(), default=-1) + 1 >= rounds // 2,
        max(1.0, until - time.monotonic()),
        "half the rounds to close",
    )
    site = cluster.sites[KILLED]
    cluster.mark_fault()
    site.kill()
    time.sleep(plan.down_s)
    site.start()


def run(folder: Path, name: str, plan: Plan) -> RunResult:
    """One job to the end; raises with the processes' logs if it did not finish cleanly."""
    shutil.rmtree(folder, ignore_errors=True)
    slow = {SLOW_SITE: ("--slowdown", f"{plan.slowdown:g}")}
    spec = spec_of(name, plan)
    with Cluster(folder, spec, delay_s=0.02, rate_bps=50e6 / 8, trainer_args=slow) as cluster:
        keeper = ThetaKeeper(cluster.state / "checkpoints", folder / "kept")
        started = time.monotonic()
        cluster.start()
        keeper.start()
        if name.endswith("-kill"):
            kill_halfway(cluster, plan, spec.coordinator_rounds, started + plan.timeout_s)
        record = cluster.finish(timeout=max(1.0, started + plan.timeout_s - time.monotonic()))
        keeper.stopped.set()
        keeper.join(5)
        keeper.scan()
        cluster.check_clean(record, name)
        sites = {site.name: site.run_dir for site in cluster.sites}
    records = {s: read_jsonl(d / "trainer_timings.jsonl") for s, d in sites.items()}
    t0 = min(r["first_step_at"] for rs in records.values() for r in steps_records(rs))
    losses = evaluate_kept(folder / "kept", plan.model)
    task_steps = plan.inner_steps // spec.fragments  # a coordinator round's inner steps
    per_task = plan.tokens_per_step * task_steps
    tokens = counted_by_version(record.events, per_task)
    trained = {s: tokens_trained(rs, plan.tokens_per_step) for s, rs in records.items()}
    counted = counted_by_site(record.events, per_task)
    result = RunResult(
        name=name,
        sites={s: SiteUse.from_records(rs) for s, rs in records.items()},
        killed=f"site-{KILLED}" if name.endswith("-kill") else "",
        tokens_trained=sum(trained.values()),
        by_site={s: (trained[s], counted.get(s, 0.0)) for s in trained},
        points=points_of(keeper.written, losses, tokens, t0),
    )
    for path in [folder / "kept", folder / "state" / "checkpoints"]:
        shutil.rmtree(path, ignore_errors=True)
    return result
