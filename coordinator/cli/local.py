"""``coordinator local --sites N [--nproc-per-node W] [--config job.toml] -- train.py ARGS``.

The command line, the watch loop and the summary; the processes are ``local_job``'s, the
numbers ``local_report``'s. Progress is drawn with rich on a terminal; elsewhere (a log, a
test) the same lines are printed plainly as the rounds close.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

from coordinator.cli.local_job import (
    OPERATOR,
    LocalPlan,
    Processes,
    make_pki,
    site_names,
    wait_listening,
)
from coordinator.cli.local_report import (
    by_round,
    environment,
    hash_check,
    plot,
    read_metrics,
    round_line,
)
from coordinator.cli.local_report import summary_table as table
from coordinator.import_path import describe

POLL_S = 0.5


def add_local_parser(sub) -> None:
    p = sub.add_parser(
        "local",
        help="run a whole job on this machine: a coordinator and N sites over loopback TLS",
        usage="coordinator local --sites N [options] -- SCRIPT [ARGS...]",
    )
    p.add_argument("--sites", type=int, required=True, metavar="N", help="local sites to run")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="W", help="trainers/site")
    p.add_argument("--config", default="job.toml", help="the job's TOML file (default job.toml)")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    p.add_argument("--run-dir", default="runs/local", help="PKI, state, logs (runs/local)")
    p.add_argument("--fresh", action="store_true", help="start over: remove --run-dir first")


class Stopped(Exception):
    """SIGINT or SIGTERM: stop every process, keep the state."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


def run_local(args, script: list[str]) -> int:
    """Run the job to its end; 0 when it completed and every site holds the final theta."""
    from rich.console import Console

    from wire.config_table import ConfigError

    if args.sites < 1 or args.nproc_per_node < 1:
        raise ConfigError("--sites and --nproc-per-node must be >= 1")
    if not script or not Path(script[0]).is_file():
        raise ConfigError(f"training script {script[0] if script else ''!r} not found after --")
    if not Path(args.config).is_file():
        raise ConfigError(f"no job config {args.config}: pass --config FILE")
    folders = job_import_folders(args.config, args.set)  # before anything is started
    run_dir = Path(args.run_dir).absolute()
    if args.fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = LocalPlan(
        run_dir, Path(args.config).absolute(), site_names(args.sites), args.nproc_per_node,
        tuple(script), tuple(args.set), tuple(folders),
    )  # fmt: skip
    console = Console(highlight=False, soft_wrap=True)
    make_pki(plan)
    console.print(
        f"isthmus local: coordinator and {args.sites} site(s) x {args.nproc_per_node} "
        f"trainer(s) on loopback, mutual TLS (certificates in {plan.pki}); logs in {run_dir}"
    )
    if folders:
        console.print(describe(folders), markup=False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_stopped)
    started = time.monotonic()
    procs = Processes(run_dir, plan.environ())
    try:
        return _run(plan, procs, console, started)
    except Stopped as stop:
        console.print(
            f"stopped by {signal.Signals(stop.signum).name}; every process stopped cleanly, "
            f"the job's state is in {plan.state_dir}: the same command resumes it"
        )
        return 128 + stop.signum
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # no second interrupt in the middle of the stop
        procs.stop(plan.sites)
        procs.stop(["coordinator"])
        procs.close()


def job_import_folders(config: str, overrides: list[str]) -> dict[Path, list[str]]:
    """The folders the job's own modules import from (``coordinator.import_path``), found
    from the config file whatever the working directory; a ``ConfigError`` for a module
    found nowhere, or a config that does not load."""
    from coordinator.config import load_config
    from coordinator.import_path import import_folders, job_modules

    cfg = load_config(config, overrides)
    return import_folders(job_modules(cfg), Path(config), Path.cwd())


def _run(plan: LocalPlan, procs: Processes, console, started: float) -> int:
    (plan.state_dir / "address").unlink(missing_ok=True)
    procs.start("coordinator", plan.serve_command())
    address = wait_listening(procs, plan.state_dir, timeout_s=300)
    if address is None:  # a complete job says so and exits 0; anything else is an error
        code = procs.procs["coordinator"].wait()
        console.print(procs.tail("coordinator", 1))
        return _summary(plan, console, started) if code == 0 else code
    for site in plan.sites:
        procs.start(site, plan.site_command(site, address))
    failed = _watch(plan, procs, address, console)
    if failed:
        console.print(f"{failed} failed (its log: {plan.run_dir / (failed + '.log')}):")
        console.print(procs.tail(failed), markup=False)
        return 1
    code = procs.procs["coordinator"].wait(timeout=120)
    if code != 0:
        console.print(f"the coordinator exited with {code}:", markup=False)
        console.print(procs.tail("coordinator"), markup=False)
        return code
    return _summary(plan, console, started)


def _watch(plan: LocalPlan, procs: Processes, address: str, console) -> str | None:
    """Show the rounds until every site is done; the name of a process that failed, if any."""
    from rich.progress import BarColumn, Progress, TextColumn

    status = _StatusReader(address, plan.pki / "operators" / OPERATOR)
    shown = [0]  # rounds closed and printed so far
    columns = (
        TextColumn("round {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[sites]}"),
    )
    try:
        with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task("rounds", total=None, sites="")
            while procs.running(plan.sites):
                if failed := procs.failed():
                    return failed[0]
                if (reply := status.read()) is not None:
                    bar.update(task, completed=reply.round.round, sites=_phases(reply))
                    bar.update(task, total=reply.round.total_rounds)
                    _print_closed(plan, reply, shown, console)
                time.sleep(POLL_S)
            if (reply := status.read()) is not None:  # rounds closed since the last look
                _print_closed(plan, reply, shown, console)
    finally:
        status.close()
    failed = procs.failed()
    return failed[0] if failed else None


def _print_closed(plan: LocalPlan, reply, shown: list[int], console) -> None:
    """A line for each round that closed since the last one printed."""
    closed = reply.round.round
    if closed <= shown[0]:
        return
    rounds = by_round(read_metrics(plan.run_dir, plan.sites))
    mb = (reply.wan_bytes_in + reply.wan_bytes_out) / 1e6
    for r in range(shown[0], closed):
        console.print(round_line(r + 1, reply.round.total_rounds, rounds.get(r, {}), mb))
    shown[0] = closed


def _phases(reply) -> str:
    return "  ".join(f"{s.site}: {s.progress.phase or s.state}" for s in reply.sites)


class _StatusReader:
    """``Status`` calls with the operator's bundle; None while the coordinator is not there."""

    def __init__(self, address: str, bundle_dir: Path) -> None:
        from wire.identity import Bundle
        from wire.net.channel import open_channel
        from wire.proto import isthmus_pb2_grpc as pb_grpc

        self.channel = open_channel(address, Bundle.load(bundle_dir))
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    def read(self):
        import grpc

        from wire.proto import isthmus_pb2 as pb

        try:
            return self.stub.Status(pb.StatusRequest(), timeout=2)
        except grpc.RpcError:
            return None

    def close(self) -> None:
        self.channel.close()


def _summary(plan: LocalPlan, console, started: float) -> int:
    from coordinator.persist.export import final_model_path, read_card

    rounds = by_round(read_metrics(plan.run_dir, plan.sites))
    console.print("")
    for row in table(rounds):
        console.print(row, markup=False)
    final = final_model_path(plan.state_dir)
    try:
        card = read_card(final)
    except (OSError, ValueError):
        console.print(f"no final model in {final.parent}")
        return 1
    check = hash_check(plan.run_dir, plan.sites, card.theta_digest)
    console.print(f"\nfinal model: {final} (round {card.round})", markup=False)
    console.print(check.line())
    console.print(environment(), markup=False)
    png = plot(rounds, plan.run_dir / "metrics.png", f"{len(plan.sites)} local sites")
    elapsed = f"elapsed {time.monotonic() - started:.0f}s"
    console.print(elapsed + (f"; plots in {png}" if png else ""))
    return 0 if check.matches else 1


def split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """``local`` arguments before ``--``, the training command after it."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]
