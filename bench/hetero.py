"""Sites of different speeds: blocking DiLoCo, streaming and async side by side.

::

    python -m bench.hetero [--quick] [--runs blocking,streaming,async,streaming-kill,async-kill]
                           [--slowdown 2] [--down-s 5] [--rounds 6] [--inner-steps 80]
                           [--out DIR] [--png PATH]

Each run is a real job, as in ``bench.utilisation``: a ``coordinator serve`` and three
``siteclient start`` sites (one FSDP2 trainer each, ``examples/gpt_diloco/train.py``, the
0.87 M-parameter GPT) over mutual TLS, every site dialling the coordinator through its own
``bench.relay.Relay`` (20 ms each way, 50 Mbit/s per direction). Site 2 is ``--slowdown``
times slower: its trainer sleeps (F - 1) x each inner step's measured compute inside the step,
as a slower accelerator would take longer (train.py ``--slowdown``).

Runs, the same outer rounds and inner steps (``--rounds`` of H = ``--inner-steps``):

- ``blocking``: DiLoCo; every round waits for all three sites.
- ``streaming``: ``[streaming] fragments = 2, delay_steps = 3/4 of H/P``; every round waits for
  all three sites (``min_sites = 3``), the trainers wait for a late round at step tau.
- ``async``: the same streaming job with ``min_sites = 2``, a grace of the recent arrival
  spread, at most 0.3 s (a tenth of a fast site's round or less), ``merge = "when_ready"``
  (the trainers train on past tau while a round is late), ``late_discount = 0.5`` and
  ``max_staleness = 3`` (an update that misses its round folds into the next round of its
  fragment still open, up to three versions of it behind, at half weight per version).
- ``streaming-kill``, ``async-kill``: the same, with site 1 (a fast one) killed with SIGKILL,
  agent and trainers, once half the coordinator rounds have closed, and started again on the
  same run dir ``--down-s`` seconds later.

What is measured
----------------
Each site's compute utilisation (CU: seconds in step bodies over the wall time from its first
step to its last, ``bench.utilisation``), its longest wait per task, the tokens every trainer
stepped over (``steps`` records, cancelled tasks included) and the tokens counted into theta
(the coordinator's ``update`` events: a task's inner steps times a late update's discount,
times batch x sequence length). Every theta the coordinator checkpoints is kept (hard-linked
as it appears) and evaluated afterwards on held-out text (``examples.gpt_diloco.evaluate``),
which gives each run's validation loss over wall time and over counted tokens. The runs are
compared at equal wall time (the shortest run's span: the newest theta each run had
checkpointed by then) and at equal counted tokens, both from the runs without a kill; a killed
site's own CU (its downtime in it) is marked and left out of a run's lowest.

Output: a line per run, the table, the plot (``hetero.png`` in ``--out``, or ``--png``) and
last ``async_cu_min=... streaming_cu_min=... blocking_cu_min=...
async_loss_vs_streaming_pct=... async_tokens_vs_streaming=...
async_loss_vs_streaming_equal_tokens_pct=...`` (pct: 100 * (async - streaming) / streaming, at
equal wall time unless said), and with the kill runs ``streaming_kill_cu_min=...
async_kill_cu_min=... async_kill_loss_vs_streaming_kill_pct=...``. About 6 minutes on 2 cores;
``--quick`` about 3.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the cluster harness lives with the fault tests

from faults.cluster import Cluster  # noqa: E402

from bench.hetero_report import (  # noqa: E402
    RunResult,
    compare,
    counted_by_site,
    counted_by_version,
    headline,
    last_line,
    plot,
    points_of,
    site_lines,
    steps_records,
    table,
    tokens_trained,
)
from bench.progress import steps  # noqa: E402
from bench.utilisation import MODEL, QUICK_MODEL, UtilisationSpec, model_params  # noqa: E402
from bench.utilisation_report import SiteUse, read_jsonl  # noqa: E402

RUNS = ("blocking", "streaming", "async", "streaming-kill", "async-kill")
KILLED = 1  # the site a "-kill" run kills halfway (a fast one) and starts again
ASYNC = {"merge": "when_ready", "grace_s": 0.3, "late_discount": 0.5, "max_staleness": 3}
SITES, SLOW_SITE, BATCH = 3, 2, 4  # train.py's --batch-size in the harness


@dataclass(frozen=True)
class HeteroSpec(UtilisationSpec):
    """``bench.utilisation``'s job (fp32) for one of ``RUNS`` (the async settings are the
    harness's ``JobSpec`` fields, set by ``spec_of``)."""

    run: str = "blocking"

    def config(self, marker_dir: Path) -> dict:
        cfg = super().config(marker_dir)  # its strategy table replaces the harness's
        cfg["job"]["name"] = f"hetero-{self.run}"
        if self.late_discount:
            cfg["strategy"]["late_discount"] = self.late_discount
        if self.grace_s is not None:  # the recent arrival spread, at most grace_s
            cfg["rounds"]["grace_spread_factor"] = 1.0
        return cfg


@dataclass
class Plan:
    model: dict
    rounds: int
    inner_steps: int
    slowdown: float
    timeout_s: float
    down_s: float = 5.0  # how long a "-kill" run's site stays down
    runs: list[str] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return float(BATCH * self.model["seq_len"])


def spec_of(name: str, plan: Plan) -> HeteroSpec:
    name = name.removesuffix("-kill")
    streaming = name != "blocking"
    p = 2 if streaming else 1
    return HeteroSpec(
        sites=SITES,
        rounds=plan.rounds,
        inner_steps=plan.inner_steps,
        model=tuple(plan.model.items()),
        fragments=p,
        delay_steps=3 * (plan.inner_steps // p) // 4 if streaming else 0,
        min_sites=2 if name == "async" else SITES,
        deadline_s=plan.timeout_s,
        **(ASYNC if name == "async" else {}),
        run=name,
    )


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
        bad = record.problems + [f"{s} exited with {c}" for s, c in record.site_codes.items() if c]
        if record.coordinator_code != 0:
            bad.append(f"the coordinator exited with {record.coordinator_code}")
        if bad:
            raise RuntimeError(f"{name}: {'; '.join(bad)}\n{cluster.tails()}")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.hetero",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (about 3 minutes)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"of {', '.join(RUNS)}")
    p.add_argument("--slowdown", type=float, default=2.0, help="site-2's steps are F times as long")
    p.add_argument("--down-s", type=float, default=5.0, help="a -kill run's site stays down")
    p.add_argument("--rounds", type=int, help="outer rounds (default 6; quick 3)")
    p.add_argument("--inner-steps", type=int, help="H (default 80; quick 40)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--out", type=Path, help="runs' folders and the plot (default: a temp dir)")
    p.add_argument("--png", type=Path, help="the plot (default: OUT/hetero.png)")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    runs = args.runs.split(",")
    if unknown := sorted(set(runs) - set(RUNS)):
        raise SystemExit(f"--runs: unknown {unknown[0]!r}; choose from {', '.join(RUNS)}")
    h = args.inner_steps or (40 if args.quick else 80)
    if h % 8:
        raise SystemExit(f"--inner-steps: a multiple of 8 (two fragments, tau 3/4), got {h}")
    if not args.slowdown >= 1:
        raise SystemExit(f"--slowdown: >= 1, got {args.slowdown}")
    return Plan(
        model=QUICK_MODEL if args.quick else MODEL,
        rounds=args.rounds or (3 if args.quick else 6),
        inner_steps=h,
        slowdown=args.slowdown,
        timeout_s=args.timeout,
        down_s=args.down_s,
        runs=runs,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    root = args.out or Path(tempfile.mkdtemp(prefix="isthmus-hetero-"))
    root.mkdir(parents=True, exist_ok=True)
    params = model_params(plan.model)
    job = (
        f"{SITES} sites (site-{SLOW_SITE} {plan.slowdown:g}x slower), {plan.rounds} outer rounds "
        f"of H {plan.inner_steps}, GPT {params / 1e6:.2f} M params, 50 Mbit/s 20 ms links"
    )
    print(f"{len(plan.runs)} runs of {job}; folders in {root}", flush=True)
    started = time.monotonic()
    results = []
    for name in steps(plan.runs, name=lambda n: f"{n} run"):
        result = run(root / name, name, plan)
        results.append(result)
        cus = ", ".join(f"{s} {u.utilisation:.3f}" for s, u in result.sites.items())
        print(
            f"[{time.monotonic() - started:6.1f}s] {name}: CU {cus}; {result.span_s:.0f}s, "
            f"final loss {result.points[-1].loss:.4f}",
            flush=True,
        )
    compared = compare(results)
    print()
    table(results, compared)
    print(
        "\nCU: time inside inner steps / wall time from first step to last (site-2 is the slow "
        "one); wait: the longest mean wait per task of a site (between tasks and at merges). "
        "trained: every\nsite's inner steps x batch x seq; counted: the updates folded into theta "
        "(late ones at their discount). loss @: the newest theta checkpointed by then.\n* the "
        "site killed halfway: its downtime counts against its CU, which is left out of CU min."
    )
    print("\neach site's tokens counted into theta / trained (thousands):")
    print("\n".join(site_lines(results)))
    png = args.png or root / "hetero.png"
    plot(results, png, job)
    print(f"\nplot: {png}; total {time.monotonic() - started:.0f}s")
    print(last_line(headline(results, compared)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
