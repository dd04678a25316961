"""Run the whole fault matrix against real processes and print what survived.

::

    python -m bench.chaos [--only SUBSTRING ...] [--keep DIR]

Each scenario of ``tests/faults/scenarios.py`` starts a coordinator and two ``siteclient``
agents (one FSDP2 trainer each) behind their own WAN relays, injects its fault and runs the
job to the end; deterministic scenarios are compared with a crash-free run of the same job.
The table gives, per scenario: whether every invariant held, rounds never closed, updates
counted twice (a site twice in a round or a round closed twice, by the checkpoints and the
coordinator's event log; data units the coordinator's ledger committed twice) and the
recovery time, from the fault (for a cut link: from its return) to the next round closing.
The last line sums it up for scripts (``max_recovery_s`` over the scenarios that survived)::

    scenarios=N survived=N lost_rounds=N double_counted=N max_recovery_s=X
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the scenarios and their harness live with the tests

from faults.scenarios import SCENARIOS, Result, reference_hash, run_scenario  # noqa: E402

from bench.progress import steps  # noqa: E402
from bench.sync_report import print_table  # noqa: E402

COLUMNS = ("scenario", "survived", "rounds lost", "double counted", "recovery s", "wall s")


def row(result: Result) -> tuple[str, ...]:
    v = result.verdict
    recovery = f"{v.recovery_s:.1f}" if v.recovery_s is not None else "-"
    return (
        result.scenario.name,
        "yes" if v.survived else "NO",
        str(len(v.lost_rounds)),
        str(v.double_counted),
        recovery,
        f"{result.seconds:.0f}",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=[], help="run scenarios whose name has one")
    p.add_argument("--keep", type=Path, help="keep every run's folder (logs, state) here")
    args = p.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.only or any(o in s.name for o in args.only)]
    if not chosen:
        p.error(f"no scenario matches {args.only}")
    root = args.keep or Path(tempfile.mkdtemp(prefix="isthmus-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    rows, results = [], []
    started = time.monotonic()
    try:
        for scenario in steps(chosen, lambda s: s.name):
            slug = re.sub(r"[^a-z0-9]+", "-", scenario.name.lower()).strip("-")
            reference = None
            if scenario.deterministic:
                reference = reference_hash(scenario.spec, root / f"reference-{slug}")
            result = run_scenario(scenario, root / slug, reference)
            results.append(result)
            rows.append(row(result))
            v = result.verdict
            print(f"    {'survived' if v.survived else 'FAILED'} in {result.seconds:.0f}s")
            for problem in v.problems:
                print("    " + problem.splitlines()[0], flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print_table(rows, COLUMNS)
    print(f"\nwall time {time.monotonic() - started:.0f}s")
    # Over the scenarios that survived: a failed one's "recovery" is when the harness gave up.
    recoveries = [
        r.verdict.recovery_s
        for r in results
        if r.verdict.survived and r.verdict.recovery_s is not None
    ]
    print(
        f"scenarios={len(results)} "
        f"survived={sum(r.verdict.survived for r in results)} "
        f"lost_rounds={sum(len(r.verdict.lost_rounds) for r in results)} "
        f"double_counted={sum(r.verdict.double_counted for r in results)} "
        f"max_recovery_s={max(recoveries, default=0.0):.1f}"
    )
    return 0 if all(r.verdict.survived for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
