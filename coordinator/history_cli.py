"""``coordinator history --state-dir DIR``: the per-round table, JSON, CSV and PNG plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_history_parser(sub) -> None:
    h = sub.add_parser("history", help="the rounds of a job, running or finished, from its log")
    h.add_argument("--state-dir", required=True, help="the job's state folder (job.state_dir)")
    form = h.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON list of rounds")
    form.add_argument("--csv", action="store_true", help="CSV, one row per round")
    h.add_argument("--plots", metavar="DIR", help="also write PNG plots into DIR")


def run_history(args: argparse.Namespace) -> int:
    from coordinator.event_history import read_events
    from coordinator.history import as_csv, as_json, plot, rounds_of, table

    log = Path(args.state_dir) / "events.jsonl"
    try:
        rounds = rounds_of(read_events(log))
    except FileNotFoundError:
        print(
            f"coordinator: error: no event log in {args.state_dir} (expected {log}); is it the "
            "job's state_dir?",
            file=sys.stderr,
        )
        return 2
    print(as_json(rounds) if args.json else as_csv(rounds) if args.csv else table(rounds))
    if args.plots:
        try:
            written = plot(rounds, Path(args.plots))
        except ImportError:
            print(
                "coordinator: error: --plots needs matplotlib (pip install 'isthmus[examples]')",
                file=sys.stderr,
            )
            return 2
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    return 0
