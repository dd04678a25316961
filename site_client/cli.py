"""``siteclient start``: the one process a site runs.

::

    siteclient start --coordinator HOST:PORT[,HOST:PORT] --site NAME
        [--nproc-per-node N ...torchrun flags] -- SCRIPT [ARGS...]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from wire.cli_flags import (
    add_security_flags,
    add_version_flag,
    bundle_from_flags,
    configure_logging,
    env_defaults,
    quiet_grpc,
)
from wire.identity import IdentityError
from wire.net.leader import parse_addresses

USAGE_HINT = "see `siteclient start --help`"
# Every flag of the agent's own has a variable, as torchrun's launch flags have PET_*.
ENV = {
    "--coordinator": "ISTHMUS_COORDINATOR",
    "--site": "ISTHMUS_SITE",
    "--run-dir": "ISTHMUS_RUN_DIR",
    "--checkpoint-url": "ISTHMUS_CHECKPOINT_URL",
    "--checkpoint-dir": "ISTHMUS_CHECKPOINT_DIR",
    "--inner-steps": "ISTHMUS_INNER_STEPS",
    "--connect-timeout": "ISTHMUS_CONNECT_TIMEOUT",
    "--outage-timeout": "ISTHMUS_OUTAGE_TIMEOUT",
    "--log-level": "ISTHMUS_LOG_LEVEL",
    "--tls-dir": "ISTHMUS_TLS_DIR",
    "--insecure": "ISTHMUS_INSECURE",
}


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="siteclient", description="The isthmus site agent.")
    add_version_flag(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    s = sub.add_parser(
        "start",
        help="join a job and run this site's trainers",
        usage="siteclient start --coordinator HOST:PORT --site NAME [options] "
        "[torchrun launch flags] -- SCRIPT [ARGS...]",
        epilog="Launch flags are torchrun's (--nproc-per-node, --nnodes, --node-rank, "
        "--rdzv-backend, --rdzv-endpoint, --max-restarts (default 3 here), --log-dir, ...).",
    )
    s.add_argument(
        "--coordinator",
        required=True,
        metavar="HOST:PORT",
        help="the coordinator; several separated by commas (standby coordinators, "
        "`coordinator serve --ha`): the site follows the leader",
    )
    s.add_argument("--site", required=True, help="this site's name in the job")
    s.add_argument("--run-dir", help="site-local state: checkpoints, metrics (default runs/SITE)")
    _add_checkpoint_flags(s)
    s.add_argument(
        "--inner-steps",
        type=int,
        metavar="H",
        help="inner steps per round at this site (default: the job's H)",
    )
    s.add_argument(
        "--connect-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="give up joining the job after this long (default 120)",
    )
    s.add_argument(
        "--outage-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="once joined, how long to keep retrying an unreachable coordinator (a restart, a "
        "WAN cut) before giving up (default 3600)",
    )
    s.add_argument(
        "--metrics",
        metavar="[HOST:]PORT",
        type=_metrics_address,
        help="serve Prometheus metrics on this port (127.0.0.1 unless HOST is given)",
    )
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    add_security_flags(s, "this site")
    env_defaults(s, ENV, os.environ)
    return p


def _add_checkpoint_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--checkpoint-url",
        default="",
        metavar="s3://BUCKET[/PREFIX]",
        help="keep the trainers' checkpoints in S3-compatible storage, under PREFIX/SITE/ "
        "(endpoint and credentials from the AWS variables); default: RUN_DIR/checkpoints",
    )
    s.add_argument(
        "--checkpoint-dir",
        default="",
        metavar="DIR",
        help="keep the trainers' checkpoints in DIR (default RUN_DIR/checkpoints); a site of "
        "several hosts (--nnodes) needs one every host sees (a shared file system) or "
        "--checkpoint-url",
    )


def _metrics_address(text: str) -> str:
    from wire.net.metrics_http import MetricsAddressError, parse_metrics_address

    try:
        parse_metrics_address(text)
    except MetricsAddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise UsageError("missing `-- SCRIPT [ARGS...]`: the training script to run")
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def _launch_and_bundle(args, launch_flags: list[str], command: list[str]):
    """The trainers' launch config and this site's TLS bundle; ``UsageError`` if unusable."""
    from site_client.launch.launcher import LaunchError, nproc_per_node, parse_launch_args

    try:
        launch = parse_launch_args(launch_flags, command[0], command[1:])
    except LaunchError as exc:
        raise UsageError(f"{exc}") from exc
    if nproc_per_node(launch) < 1:
        raise UsageError(f"--nproc-per-node must be a number >= 1, got {launch.nproc_per_node!r}")
    _check_nodes(args, launch, launch_flags)
    try:
        return launch, bundle_from_flags(args)
    except IdentityError as exc:
        raise UsageError(str(exc)) from exc


def _check_nodes(args, launch, launch_flags: list[str]) -> None:
    """A site of several hosts: each names its node, and they share the checkpoints."""
    from site_client.launch.launcher import node_count

    nodes = node_count(launch)
    if nodes <= 1:
        return
    if not any(f.startswith(("--node-rank", "--node_rank")) for f in launch_flags):
        raise UsageError(
            f"--nnodes {launch.nnodes}: give each host its --node-rank (0 holds the site's lease)"
        )
    if not 0 <= launch.node_rank < nodes:
        raise UsageError(f"--node-rank {launch.node_rank} is not one of 0..{nodes - 1}")
    if not (args.checkpoint_dir or args.checkpoint_url):
        raise UsageError(
            f"--nnodes {launch.nnodes}: every host writes the site's checkpoints; give "
            "--checkpoint-dir on a file system all of them see, or --checkpoint-url"
        )


def _start(args, launch_flags: list[str], command: list[str]) -> int:
    from site_client.agent.site_agent import SiteAgent
    from site_client.launch.launcher import TrainersFailed, nproc_per_node, run_trainers
    from site_client.transfer.client import CoordinatorClient, CoordinatorError
    from wire.backoff import BackoffPolicy, DeadlineExceeded
    from wire.net.host_tuning import log_tcp_advice

    launch, bundle = _launch_and_bundle(args, launch_flags, command)
    cfg = _agent_config(args, launch)
    run_dir, node = cfg.run_dir, cfg.node
    client = CoordinatorClient(
        args.coordinator,
        args.site,
        backoff=BackoffPolicy(initial_s=0.5, cap_s=10.0, deadline_s=args.connect_timeout),
        world_size=nproc_per_node(launch) * cfg.nodes,
        tls=bundle,
        joins=node == 0,
    )
    if node > 0:
        client.backoff = BackoffPolicy(initial_s=0.5, cap_s=15.0, deadline_s=args.outage_timeout)
        return _start_node(args, launch, cfg, client)
    agent = SiteAgent(cfg, client)
    try:
        agent.start()
        # Joined: from now on a silent coordinator is an outage to ride out, not a typo.
        client.backoff = BackoffPolicy(initial_s=0.5, cap_s=15.0, deadline_s=args.outage_timeout)
        advice_log = logging.getLogger("isthmus.site")
        log_tcp_advice(advice_log, client.address, client.transfer.keep_connections)
    except (CoordinatorError, DeadlineExceeded) as exc:
        agent.stop(leave=False)
        print(f"siteclient: error: {join_failure(args.coordinator, exc)}", file=sys.stderr)
        return 1
    if args.metrics:
        _serve_agent_metrics(agent, args.metrics, run_dir)
    _trainer_env(cfg)
    try:
        run_trainers(launch, args.site, run_dir / "trainer_logs")
    except TrainersFailed as exc:
        agent.stop(leave=True)
        report = f"siteclient: error: {agent.error}" if agent.error else exc.report
        print(report, file=sys.stderr)
        return 1
    except BaseException as exc:  # SignalException, KeyboardInterrupt
        agent.stop(leave=True)
        reason = agent.error or f"{type(exc).__name__}: {str(exc).strip().splitlines()[0:1]}"
        print(f"siteclient: error: trainers of site {args.site} failed: {reason}", file=sys.stderr)
        return 1
    if not agent.error and agent.state.drained:
        return _exit_drained(agent, args.site, args.outage_timeout)
    error = agent.error
    if not error and not agent.finish_pushes(args.outage_timeout):
        error = f"the trainers left with updates unsent after {args.outage_timeout:g}s"
    agent.stop(leave=True)
    if error:
        print(f"siteclient: error: {error}", file=sys.stderr)
        return 1
    return 0


def _agent_config(args, launch):
    """The agent's config: this host's node of the site, its folders."""
    from site_client.agent.site_agent import AgentConfig, default_shm_dir
    from site_client.launch.launcher import node_count

    nodes = node_count(launch)
    node = launch.node_rank if nodes > 1 else 0
    default_run = Path("runs") / (args.site if node == 0 else f"{args.site}-node{node}")
    return AgentConfig(
        args.site,
        Path(args.run_dir or default_run).absolute(),
        default_shm_dir(args.site),
        args.inner_steps,
        checkpoint_url=args.checkpoint_url,
        checkpoint_dir=str(Path(args.checkpoint_dir).absolute()) if args.checkpoint_dir else "",
        node=node,
        nodes=nodes,
    )


def _start_node(args, launch, cfg, client) -> int:
    """Node k > 0 of a multi-node site: its host's trainers and WAN transfers, no lease."""
    from site_client.agent.node_agent import NodeAgent
    from site_client.launch.launcher import TrainersFailed, run_trainers

    agent = NodeAgent(cfg, client, cfg.node)
    agent.start()
    _trainer_env(cfg)
    try:
        run_trainers(launch, args.site, cfg.run_dir / "trainer_logs")
    except TrainersFailed as exc:
        agent.stop()
        print(f"siteclient: error: {agent.error}" if agent.error else exc.report, file=sys.stderr)
        return 1
    except BaseException as exc:  # SignalException, KeyboardInterrupt
        agent.stop()
        reason = agent.error or f"{type(exc).__name__}: {str(exc).strip().splitlines()[0:1]}"
        print(f"siteclient: error: node {cfg.node} of site {args.site}: {reason}", file=sys.stderr)
        return 1
    pushed = agent.finish_pushes(args.outage_timeout)
    error = agent.error or (None if pushed else "parts still unsent at the end")
    agent.stop()
    if error:
        print(f"siteclient: error: {error}", file=sys.stderr)
        return 1
    return 0


def _trainer_env(cfg) -> None:
    """What the trainers this process launches read: their agent's socket, the site."""
    if cfg.nodes > 1:
        # A fresh store per rendezvous round, so that a replaced host's trainers (restart
        # count 0) and the others' (count n) meet on keys of the same round only.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.update(
        ISTHMUS_AGENT_SOCKET=str(cfg.shm_dir / "agent.sock"),
        ISTHMUS_RUN_DIR=str(cfg.run_dir),
        ISTHMUS_SITE=cfg.site,
    )


def _check_checkpoint_url(url: str, site: str) -> None:
    """``UsageError`` (one line) unless ``url`` is "" or a reachable ``s3://`` folder."""
    if not url:
        return
    from site_client.checkpoint.url import CheckpointUrlError, open_checkpoint_url

    try:
        open_checkpoint_url(url, site)
    except CheckpointUrlError as exc:
        raise UsageError(str(exc)) from None


def _exit_drained(agent, site: str, timeout_s: float) -> int:
    """The trainers left because the coordinator drained the site: push what they handed
    over, then leave the job (exit 0: a drain is an operator's decision, not a failure)."""
    reason = agent.state.drained
    pushed = agent.finish_pushes(timeout_s)
    error = agent.error
    agent.stop(leave=True, reason=f"drained: {reason}")
    if error or not pushed:
        problem = error or f"updates still unsent after {timeout_s:g}s"
        print(f"siteclient: error: site {site} was drained ({reason}): {problem}", file=sys.stderr)
        return 1
    print(
        f"siteclient: site {site} was drained by the coordinator ({reason}); its work is "
        "pushed and it left the job (`coordinator undrain` lets it join again)",
        file=sys.stderr,
    )
    return 0


def _serve_agent_metrics(agent, where: str, run_dir: Path) -> None:
    from site_client.agent.metrics import agent_registry
    from wire.net.metrics_http import serve_metrics

    _server, address = serve_metrics(agent_registry(agent), where)
    (run_dir / "metrics_address").write_text(f"{address}\n")


def join_failure(address: str, exc: BaseException) -> str:
    """The one line a failed join prints: a TLS problem and a refusal are not outages."""
    from site_client.errors import CoordinatorError, TlsRefused

    if isinstance(exc, TlsRefused):
        return f"cannot join the job at {address}: {exc}"
    if isinstance(exc, CoordinatorError):
        return f"the coordinator at {address} refused the join: {_one_line(exc)}"
    return (
        f"cannot join the job at {address}: {_one_line(exc)} "
        "(is `coordinator serve` running there, and is --coordinator right?)"
    )


def _one_line(exc: BaseException) -> str:
    """A gRPC error's own words rather than its multi-line repr."""
    import grpc

    cause = exc.__cause__
    if isinstance(cause, grpc.RpcError):
        head = str(exc).split(": ", 1)[0]
        return f"{head}: {cause.code().name}: {cause.details()}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    quiet_grpc()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ours_part = argv[: argv.index("--")] if "--" in argv else argv
        wants_help = any(a in ("-h", "--help") for a in ours_part)
        if argv[:1] == ["start"] and not wants_help:
            ours, command = _split(argv)
            args, launch_flags = _parser().parse_known_args(ours)
        else:
            args, launch_flags, command = _parser().parse_args(argv), [], []
        if not command:
            raise UsageError("missing SCRIPT after `--`")
        if not Path(command[0]).is_file():
            raise UsageError(f"training script {command[0]!r} not found")
        if problem := parse_addresses(args.coordinator)[1]:
            raise UsageError(f"--coordinator {args.coordinator}: {problem}")
        if args.inner_steps is not None and args.inner_steps <= 0:
            raise UsageError(f"--inner-steps must be > 0, got {args.inner_steps}")
        for flag in ("connect_timeout", "outage_timeout"):
            if getattr(args, flag) <= 0:
                name = "--" + flag.replace("_", "-")
                raise UsageError(f"{name} must be > 0 seconds, got {getattr(args, flag)}")
        _check_checkpoint_url(args.checkpoint_url, args.site)
        unknown = [f for f in launch_flags if f.startswith("-")]
        from torch.distributed.run import get_args_parser

        known = {o for a in get_args_parser()._actions for o in a.option_strings}
        bad = [f for f in unknown if f.split("=")[0] not in known]
        if bad:
            raise UsageError(f"unknown flag {bad[0]}")
    except UsageError as exc:
        print(f"siteclient: error: {exc} ({USAGE_HINT})", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    try:
        return _start(args, launch_flags, command)
    except UsageError as exc:
        print(f"siteclient: error: {exc} ({USAGE_HINT})", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
