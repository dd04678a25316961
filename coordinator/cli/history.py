"""``coordinator history --state-dir DIR`` (or ``--storage-url s3://...``: the log a job with
``[storage] url`` keeps in object storage, whichever coordinator wrote it): the per-round
table, JSON, CSV and PNG plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_history_parser(sub) -> None:
    h = sub.add_parser("history", help="the rounds of a job, running or finished, from its log")
    where = h.add_mutually_exclusive_group(required=True)
    where.add_argument("--state-dir", help="the job's state folder (job.state_dir)")
    where.add_argument(
        "--storage-url",
        metavar="s3://BUCKET[/PREFIX]",
        help="the job's [storage] url: read the log kept there (AWS variables as for serve)",
    )
    form = h.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON list of rounds")
    form.add_argument("--csv", action="store_true", help="CSV, one row per round")
    h.add_argument("--plots", metavar="DIR", help="also write PNG plots into DIR")


def _remote_events(url: str) -> list:
    """The events of the log under ``url``; ``ValueError`` (one line) if it cannot be read."""
    from coordinator.events.remote import RemoteEvents, read_remote
    from wire.config_table import ConfigError
    from wire.objstore.config import StorageConfig, check_storage, parse_url, s3_client

    parsed = parse_url(url)
    if parsed is None:
        raise ValueError(f"--storage-url {url}: expected s3://BUCKET[/PREFIX]")
    cfg = StorageConfig(url=url)
    try:
        check_storage(cfg, where=f"--storage-url {url}")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    bucket, prefix = parsed
    remote = RemoteEvents(s3_client(cfg), bucket, f"{prefix}/" if prefix else "")
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        history = read_remote(remote)
    except (BotoCoreError, ClientError) as exc:
        raise ValueError(f"--storage-url {url}: {str(exc).splitlines()[0]}") from None
    if not history.events:
        raise ValueError(f"no event log under {remote.url()}; is it the job's [storage] url?")
    for where, gap in history.gaps:
        print(f"coordinator: warning: {gap.report(where, 'before it')}", file=sys.stderr)
    return history.events


def run_history(args: argparse.Namespace) -> int:
    from coordinator.events.format import EventLogError
    from coordinator.events.history import rounds_of
    from coordinator.events.segments import read_events

    if args.storage_url:
        try:
            rounds = rounds_of(_remote_events(args.storage_url))
        except (ValueError, EventLogError) as exc:
            print(f"coordinator: error: {exc}", file=sys.stderr)
            return 2
        return _show(rounds, args)
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
    return _show(rounds, args)


def _show(rounds, args: argparse.Namespace) -> int:
    from coordinator.events.history import as_csv, as_json, plot, table

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
