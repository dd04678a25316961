"""``Fuzzer`` (the session, the checks and every generator in one object), ``run()`` (a
fresh coordinator fuzzed with N hypothesis-generated cases) and the command line of
``python -m bench.fuzz``."""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import FlakyStrategyDefinition

from .. import fuzzing
from .checks import CaseChecks
from .constants import KIND_LIST, KINDS
from .gen_push import PushCases
from .gen_rpc import RpcCases
from .gen_spool import SpoolCases
from .gen_wire import WireCases
from .report import Report, print_report
from .session import Session


class Fuzzer(CaseChecks, RpcCases, PushCases, WireCases, SpoolCases, Session):
    """One coordinator process, the fuzzer's two sites, the cases and the checks after each."""


def run(
    cases: int = 10_000,
    seed: int | None = None,
    workdir: Path | None = None,
    progress_every: int = 1000,
    out: Callable[[str], None] = print,
    keep: bool = False,
    kinds: list[str] | None = None,
    skip_known_bugs: bool = False,
) -> Report:
    """Fuzz a fresh coordinator with ``cases`` cases; returns the report (see ``Report``)."""
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="isthmus-fuzz-")) if tmp else Path(workdir)
    logging.getLogger("grpc._channel").setLevel(logging.CRITICAL)  # our own aborted iterators
    fz = Fuzzer(workdir, seed, out)
    if progress_every:
        out(f"[fuzz] seed={seed} cases={cases} workdir={workdir}")
    fz.progress_every = progress_every
    fz.skip_known_bugs = skip_known_bugs
    if kinds:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown case kinds {sorted(unknown)}; known: {list(KINDS)}")
        fz.kind_list = [k for k in KIND_LIST if k in kinds]
    started = fz.started = time.monotonic()
    fz.start()
    try:
        batch_seed = seed
        while fz.report.cases < cases:
            before = fz.report.cases

            @settings(
                max_examples=cases - fz.report.cases,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            )
            @given(st.data())
            def drive(data):
                fz.one_case(data, cases)

            try:
                hypothesis_seed(batch_seed)(drive)()
            except FlakyStrategyDefinition:
                # Hypothesis saw one prefix of choices draw differently (a draw that depends
                # on outside state slipped in): go on with the next seed.
                fz.report.flaky_restarts += 1
            batch_seed += 1
            if fz.report.cases == before:
                raise RuntimeError("hypothesis generated no case")
    finally:
        fz.stop()
    fz.report.elapsed_s = time.monotonic() - started
    report = fz.report
    if tmp and not keep and report.crashes == 0 and report.state_changes == 0:
        shutil.rmtree(workdir, ignore_errors=True)
        report.workdir = None
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.fuzz", description=fuzzing.__doc__.splitlines()[0]
    )
    p.add_argument("--cases", type=int, default=10_000, help="cases to run (default 10000)")
    p.add_argument("--seed", type=int, help="hypothesis seed (default: random, printed)")
    p.add_argument("--workdir", type=Path, help="folder for the coordinator (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--progress-every", type=int, default=1000, help="cases between progress lines")
    p.add_argument("--kinds", help=f"comma-separated subset of: {','.join(KINDS)}")
    p.add_argument(
        "--skip-known-bugs", action="store_true", help="do not send cases that hit KNOWN_BUGS"
    )
    args = p.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else None
    report = run(
        args.cases,
        args.seed,
        args.workdir,
        args.progress_every,
        print,
        args.keep,
        kinds,
        args.skip_known_bugs,
    )
    print_report(report)
    return 1 if report.crashes or report.state_changes else 0
