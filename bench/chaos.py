"""Run the whole fault matrix against real processes and print what survived.

::

    python -m bench.chaos [--only SUBSTRING ...] [--keep DIR]

Each scenario of ``tests/faults/scenarios.py`` starts a job of two ``siteclient`` agents (one
FSDP2 trainer each), injects its fault and runs the job to the end; deterministic scenarios
are compared with a crash-free run of the same job. Most run on one coordinator, each site
behind its own WAN relay; the ``standby:`` rows run on two ``serve --ha`` coordinators, one
leading and one standing by, on one etcd and one SeaweedFS that this bench starts for them
(they are skipped, saying why, where either is not installed), and add their own checks (a
deposed leader stops within its lease and exits 4, one writer per round in the store, every
reported checkpoint committed). The table gives, per scenario: whether every invariant and
check held, rounds never closed, updates counted twice (a site twice in a round or a round
closed twice, by the checkpoints and the coordinator's event log; data units the
coordinator's ledger committed twice) and the recovery time, from the fault (for a cut link
or store: from its return) to the next round closing. The last line sums it up for scripts
(``max_recovery_s`` over the scenarios that survived; ``ha_scenarios`` of the ``scenarios``
that ran on standby coordinators)::

    scenarios=N survived=N lost_rounds=N double_counted=N max_recovery_s=X ha_scenarios=N
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the scenarios and their harness live with the tests

from faults.ha_scenarios import Servers, standby_servers, unavailable  # noqa: E402
from faults.scenarios import SCENARIOS, Result, Scenario, reference_hash, run_scenario  # noqa: E402

from bench.progress import steps  # noqa: E402
from bench.sync_report import print_table  # noqa: E402

COLUMNS = ("scenario", "survived", "rounds lost", "double counted", "recovery s", "wall s")


@dataclass(frozen=True)
class Skipped:
    """Scenarios chosen but not run, and why; ``failed``: a server that should have started
    did not (the run fails), rather than one not installed here."""

    names: tuple[str, ...]
    reason: str
    failed: bool = False

    def line(self) -> str:
        return f"skipped {len(self.names)} standby scenario(s): {self.reason}"


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


def run_one(scenario: Scenario, root: Path, servers: Servers | None) -> Result:
    slug = re.sub(r"[^a-z0-9]+", "-", scenario.name.lower()).strip("-")
    reference = None
    if scenario.deterministic:
        reference = reference_hash(scenario.spec, root / f"reference-{slug}")
    result = run_scenario(scenario, root / slug, reference, servers)
    v = result.verdict
    print(f"    {'survived' if v.survived else 'FAILED'} in {result.seconds:.0f}s")
    for problem in v.problems:
        print("    " + problem.splitlines()[0], flush=True)
    return result


def run_all(chosen: list[Scenario], root: Path) -> tuple[list[Result], Skipped | None]:
    """Run ``chosen`` in order; etcd and SeaweedFS start before the first standby row (the
    standby rows come last) and stop after the last."""
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        servers = None
        for scenario in steps(chosen, lambda s: s.name):
            if scenario.standby is not None and servers is None:
                try:
                    servers = stack.enter_context(standby_servers(root / "servers"))
                except Exception as exc:  # every standby row needs them: skip the rest
                    rest = tuple(s.name for s in chosen if s.standby is not None)
                    reason = f"etcd or SeaweedFS did not start: {gist(exc)}"
                    print(f"    {reason}", flush=True)
                    return results, Skipped(rest, reason, failed=True)
            results.append(run_one(scenario, root, servers))
    return results, None


def gist(exc: Exception) -> str:
    """An error in one line: its first and, for a log tail, its last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def summary(results: list[Result]) -> str:
    """The last line, for scripts."""
    # Over the scenarios that survived: a failed one's "recovery" is when the harness gave up.
    recoveries = [
        r.verdict.recovery_s
        for r in results
        if r.verdict.survived and r.verdict.recovery_s is not None
    ]
    return (
        f"scenarios={len(results)} "
        f"survived={sum(r.verdict.survived for r in results)} "
        f"lost_rounds={sum(len(r.verdict.lost_rounds) for r in results)} "
        f"double_counted={sum(r.verdict.double_counted for r in results)} "
        f"max_recovery_s={max(recoveries, default=0.0):.1f} "
        f"ha_scenarios={sum(r.scenario.standby is not None for r in results)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=[], help="run scenarios whose name has one")
    p.add_argument("--keep", type=Path, help="keep every run's folder (logs, state) here")
    args = p.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.only or any(o in s.name for o in args.only)]
    if not chosen:
        p.error(f"no scenario matches {args.only}")
    skipped = None
    standby = tuple(s.name for s in chosen if s.standby is not None)
    if standby and (reason := unavailable()) is not None:
        skipped = Skipped(standby, reason)
        print(skipped.line(), flush=True)
        chosen = [s for s in chosen if s.standby is None]
    root = args.keep or Path(tempfile.mkdtemp(prefix="isthmus-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        results, failed_start = run_all(chosen, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    skipped = failed_start or skipped
    print()
    print_table([row(r) for r in results], COLUMNS)
    print(f"\nwall time {time.monotonic() - started:.0f}s")
    if skipped is not None:
        print(skipped.line())
    print(summary(results))
    ok = all(r.verdict.survived for r in results)
    return 0 if ok and not (skipped and skipped.failed) else 1


if __name__ == "__main__":
    sys.exit(main())
