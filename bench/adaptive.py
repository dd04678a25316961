"""Adaptive compression on a link whose rate changes mid-run: fixed codecs against the ladder.

::

    python -m bench.adaptive [--quick] [--runs fp32,int8,int4,adaptive] [--out DIR] [--png PATH]
                             [--fast-mbit 50] [--slow-mbit 4] [--delay-ms 40]
                             [--phase-rounds 4,10,4] [--inner-steps 160] [--delay-steps 60] ...

Each run is a real job, as in ``bench.utilisation``: a ``coordinator serve`` and two
``siteclient start`` sites (one FSDP2 trainer each, ``examples/gpt_diloco/train.py``, the same
0.87 M-parameter GPT, 3.5 MB in float32) over mutual TLS, every site dialling the coordinator
through its own ``bench.relay.Relay``: 40 ms each way and a rate cap per direction. Streaming
DiLoCo, ``[streaming] fragments = 2, delay_steps = 60`` of H = 160: a coordinator round is one
fragment's sync (1.7 MB in float32) after 80 inner steps, merged 60 steps later.

The link follows one schedule in every run, switched by the coordinator's closed rounds (not
by wall time, so that each phase holds the same rounds, the same inner steps, in every run
however long its waits): 50 Mbit/s for 4 rounds, 4 Mbit/s once those have closed, 50 Mbit/s
again after 10 more. On the fast link a fragment's float32 push and fetch take about 0.3 s
each, well inside tau; on the slow one 3.5 s each, far outside it.

Runs, same schedule and inner steps: ``fp32`` (no ``[compression]``: raw float32 both ways),
``int8`` and ``int4`` (``default`` codec both ways) and ``adaptive`` (``mode = "adaptive"``,
ladder none, int8, int4, ``deadline_fraction`` 0.6 (the default), on both links).

What is measured
----------------
A site's compute utilisation (CU) is ``bench.utilisation``'s: seconds inside the trainer's step
bodies over the wall time from the first step to the last, from its ``"steps"`` records (one
per task, a coordinator round), taken over the whole run and over each phase's tasks; a run's
CU is the lowest of its two sites'. A phase's rounds push at its rate (the link takes it once
the round before has closed, so that round's delta is fetched at it too); task k merges round
k - 1's sync tau steps in, so it counts in the slower phase of that sync's push and fetch: the
slow phase's tasks are every task that waited for a transfer on the slow link, the first one
after the link is fast again included. WAN bytes are what crossed both sites' relays, both
directions, theta_0 and the final theta included; the validation loss is the sites' trainers'
for the final theta (their mean). The codec of each round comes from each site's ``"push"`` timing
records (``codec``, ``predicted_s``, ``deadline_s``) and from the coordinator's
``round_closed`` events (``downlink_codec``).

Output: a line per run as it finishes, the table, the adaptive run's codecs per round, the
plot (``adaptive.png`` in ``--out``, or ``--png``), and last ``adaptive_cu=...
adaptive_cu_slow=... adaptive_loss_vs_fp32_pct=... fixed_int4_loss_vs_fp32_pct=...
fixed_fp32_cu=... fixed_fp32_cu_slow=...`` (loss_vs_fp32_pct: 100 * (loss - fp32's) /
fp32's). About 7 minutes on 2 cores; ``--quick``: H 80 (tau 30), rounds 2, 4, 2, about 3
minutes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the cluster harness lives with the fault tests

from faults.cluster import Cluster  # noqa: E402

from bench.adaptive_report import (  # noqa: E402
    LADDER,
    Phase,
    RunResult,
    codec_lines,
    downlink_codecs,
    headline,
    last_line,
    phase_bounds,
    phase_uses,
    plot,
    read_pushes,
    slowest_phase,
    table,
    uplink_codecs,
)
from bench.progress import steps  # noqa: E402
from bench.utilisation import (  # noqa: E402
    MODEL,
    UtilisationSpec,
    drop_bulk,
    model_params,
)
from bench.utilisation_report import final_val_loss, read_jsonl, site_use  # noqa: E402

RUNS = ("fp32", "int8", "int4", "adaptive")


@dataclass(frozen=True)
class AdaptiveSpec(UtilisationSpec):
    """``bench.utilisation``'s job (its ``codec`` fixed on both links), or with ``adaptive``
    the ladder on both links instead."""

    adaptive: bool = False
    deadline_fraction: float = 0.6

    def config(self, marker_dir: Path) -> dict:
        cfg = super().config(marker_dir)
        cfg["job"]["name"] = "adaptive-" + ("ladder" if self.adaptive else self.codec)
        if self.adaptive:
            ladder = {"mode": "adaptive", "ladder": list(LADDER)}
            ladder["deadline_fraction"] = self.deadline_fraction
            cfg["compression"] = ladder
            cfg["compression.downlink"] = dict(ladder)
        return cfg


@dataclass
class Plan:
    """What every run of an invocation shares."""

    model: dict
    inner_steps: int
    fragments: int
    delay_steps: int
    phases: list[Phase]
    delay_s: float
    timeout_s: float
    deadline_fraction: float
    runs: list[str] = field(default_factory=list)

    @property
    def coordinator_rounds(self) -> int:
        return sum(p.rounds for p in self.phases)


def bytes_per_s(mbit: float) -> float:
    return mbit * 1e6 / 8


def spec_of(name: str, plan: Plan) -> AdaptiveSpec:
    return AdaptiveSpec(
        rounds=plan.coordinator_rounds // plan.fragments,
        inner_steps=plan.inner_steps,
        model=tuple(plan.model.items()),
        codec="fp32" if name == "adaptive" else name,
        adaptive=name == "adaptive",
        deadline_fraction=plan.deadline_fraction,
        fragments=plan.fragments,
        delay_steps=plan.delay_steps,
        deadline_s=plan.timeout_s,
    )


def closed_rounds(cluster: Cluster) -> int:
    """How many coordinator rounds have closed (their checkpoints seen)."""
    return max(cluster.watcher.closed_rounds(), default=-1) + 1


def follow_schedule(cluster: Cluster, phases: list[Phase], until: float) -> None:
    """Set every site's link to each phase's rate once the rounds before it have closed."""
    for (first, _), phase in zip(phase_bounds(phases)[1:], phases[1:], strict=True):
        cluster.wait_for(
            lambda first=first: closed_rounds(cluster) >= first,
            max(1.0, until - time.monotonic()),
            f"round {first - 1} to close",
        )
        for relay in cluster.relays:
            relay.set_rate(bytes_per_s(phase.mbit))


def run(folder: Path, name: str, plan: Plan) -> RunResult:
    """One job to the end; raises with the processes' logs if it did not finish cleanly."""
    shutil.rmtree(folder, ignore_errors=True)  # a previous invocation's logs and records
    started = time.monotonic()
    rate = bytes_per_s(plan.phases[0].mbit)
    with Cluster(folder, spec_of(name, plan), delay_s=plan.delay_s, rate_bps=rate) as cluster:
        cluster.start()
        follow_schedule(cluster, plan.phases, started + plan.timeout_s)
        record = cluster.finish(timeout=max(1.0, started + plan.timeout_s - time.monotonic()))
        counters = [relay.counters() for relay in cluster.relays]
        cluster.check_clean(record, name)
        sites = {site.name: site.run_dir for site in cluster.sites}
    fixed = "none" if name in ("fp32", "adaptive") else name
    losses = [final_val_loss(d) for d in sites.values()]
    result = RunResult(
        name=name,
        sites=[site_use(d) for d in sites.values()],
        phases=[
            phase_uses(read_jsonl(d / "trainer_timings.jsonl"), plan.phases) for d in sites.values()
        ],
        bytes_up=sum(c.bytes_up for c in counters),
        bytes_down=sum(c.bytes_down for c in counters),
        val_loss=sum(losses) / len(losses),
        uplink={s: uplink_codecs(read_pushes(d), fixed) for s, d in sites.items()},
        downlink=downlink_codecs(record.events, fixed),
        seconds=time.monotonic() - started,
    )
    drop_bulk(folder)
    return result


def adaptive_rounds(folder: Path, result: RunResult, plan: Plan) -> None:
    """Print the adaptive run's choice per round: each site's uplink codec with its
    predicted push time against its deadline, and the downlink's codec."""
    phase_of = {}
    for phase, (first, end) in zip(plan.phases, phase_bounds(plan.phases), strict=True):
        phase_of.update(dict.fromkeys(range(first, end), f"{phase.name} {phase.mbit:g}"))
    pushes = {s: {p["round"]: p for p in read_pushes(folder / s)} for s in result.uplink}
    print("round  link     " + "  ".join(f"{s:<28}" for s in pushes) + "  downlink")
    for r in range(plan.coordinator_rounds):
        cells = []
        for by_round in pushes.values():
            p = by_round.get(r, {})
            predicted, deadline = p.get("predicted_s"), p.get("deadline_s")
            timing = "" if predicted is None else f" {predicted:.2f}/{deadline:.2f}s"
            cells.append(f"{p.get('codec', '-')}{timing} took {p.get('s', 0):.2f}s")
        print(f"{r:<6} {phase_of[r]:<8} " + "  ".join(f"{c:<28}" for c in cells)
              + f"  {result.downlink.get(r, '-')}")  # fmt: skip


def parse_phase_rounds(text: str, fast: float, slow: float) -> list[Phase]:
    """``"4,10,4"``: fast, slow, fast rounds (coordinator rounds)."""
    counts = [int(x) for x in text.split(",")]
    if len(counts) != 3 or min(counts) < 1:
        raise SystemExit(f"--phase-rounds: three positive counts (fast,slow,fast), got {text!r}")
    return [Phase("fast1", fast, counts[0]), Phase("slow", slow, counts[1]),
            Phase("fast2", fast, counts[2])]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.adaptive",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (about 3 minutes)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"of {', '.join(RUNS)}")
    p.add_argument("--phase-rounds", help="coordinator rounds fast,slow,fast (default 4,10,4; "
                   "quick 2,4,2); their sum a multiple of --fragments")  # fmt: skip
    p.add_argument("--inner-steps", type=int, help="H (default 160; quick 80)")
    p.add_argument("--fragments", type=int, default=2, help="streaming's P")
    p.add_argument("--delay-steps", type=int, help="tau (default 3/4 of H/P)")
    p.add_argument("--fast-mbit", type=float, default=50.0, help="the fast link, per direction")
    p.add_argument("--slow-mbit", type=float, default=4.0, help="the slow link, per direction")
    p.add_argument("--delay-ms", type=float, default=40.0, help="one-way delay")
    p.add_argument("--deadline-fraction", type=float, default=0.6, help="the ladder's")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--out", type=Path, help="runs' folders and the plot (default: a temp dir)")
    p.add_argument("--png", type=Path, help="the plot (default: OUT/adaptive.png)")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    runs = args.runs.split(",")
    if unknown := sorted(set(runs) - set(RUNS)):
        raise SystemExit(f"--runs: unknown {unknown[0]!r}; choose from {', '.join(RUNS)}")
    h = args.inner_steps or (80 if args.quick else 160)
    p = args.fragments
    tau = args.delay_steps if args.delay_steps is not None else 3 * (h // p) // 4
    phases = parse_phase_rounds(
        args.phase_rounds or ("2,4,2" if args.quick else "4,10,4"), args.fast_mbit, args.slow_mbit
    )
    total = sum(phase.rounds for phase in phases)
    if p < 1 or h % p or not 0 < tau < h // p or total % p:
        raise SystemExit(
            f"need H % P == 0, 0 < tau < H/P and the rounds a multiple of P; got H={h}, P={p}, "
            f"tau={tau}, {total} rounds"
        )
    return Plan(
        model=MODEL,
        inner_steps=h,
        fragments=p,
        delay_steps=tau,
        phases=phases,
        delay_s=args.delay_ms / 1000,
        timeout_s=args.timeout,
        deadline_fraction=args.deadline_fraction,
        runs=runs,
    )


def describe(plan: Plan) -> tuple[str, str]:
    """The model and the link schedule, in words (the header and the plot's title)."""
    params = model_params(plan.model)
    model = f"GPT {params / 1e6:.2f} M params ({params * 4 / 1e6:.1f} MB fp32)"
    link = " -> ".join(f"{p.mbit:g} Mbit/s x{p.rounds}" for p in plan.phases)
    job = (
        f"2 sites, H {plan.inner_steps}, P {plan.fragments}, tau {plan.delay_steps}, {model}; "
        f"link {link} rounds, {plan.delay_s * 1000:g} ms each way"
    )
    return model, job


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    root = args.out or Path(tempfile.mkdtemp(prefix="isthmus-adaptive-"))
    root.mkdir(parents=True, exist_ok=True)
    _, job = describe(plan)
    print(f"{len(plan.runs)} runs of {job}; folders in {root}", flush=True)
    started = time.monotonic()
    results = []
    for name in steps(plan.runs, name=lambda n: f"{n} run"):
        result = run(root / name, name, plan)
        results.append(result)
        slow = slowest_phase(plan.phases)
        print(
            f"[{time.monotonic() - started:6.1f}s] {name}: CU {result.cu:.3f}, slow phase "
            f"{result.cu_phase(slow):.3f}, WAN {result.wan_mb:.1f} MB, val loss "
            f"{result.val_loss:.4f}, run {result.seconds:.0f}s",
            flush=True,
        )
    print()
    table(results, plan.phases)
    print(
        "\nCU: time inside inner steps / wall time from first step to last, the lowest site; "
        "per phase over\nthat phase's tasks. WAN MB: both sites' relays, both directions."
    )
    for result in results:
        if result.name == "adaptive":
            print("\nthe adaptive run's codecs per round:")
            print("\n".join(codec_lines(result)))
            print(
                "\nper round (link: the rate its push went at): uplink codec, predicted/deadline "
                "s, push s (each site); downlink codec:"
            )
            adaptive_rounds(root / result.name, result, plan)
    png = args.png or root / "adaptive.png"
    plot(results, plan.phases, png, job)
    print(f"\nplot: {png}; total {time.monotonic() - started:.0f}s")
    print(last_line(headline(results, plan.phases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
