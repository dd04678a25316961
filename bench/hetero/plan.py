"""The runs of ``python -m bench.hetero`` (see the package docstring): their jobs, and the
invocation's plan from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import bench.hetero
from bench.utilisation import MODEL, QUICK_MODEL, UtilisationSpec

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.hetero",
        description=bench.hetero.__doc__,
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
