"""``coordinator``: serve a job, show the status of a running one, drain its sites.

Only the standard library and small modules load before the command line is parsed: torch and
grpc are imported by the command that needs them, so ``--help`` and usage errors are instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from coordinator.cli.certs import add_certs_parser, run_certs
from coordinator.cli.export import ExportError, add_export_parser, run_export
from coordinator.cli.ha import add_ha_flags, call_leader, check_advertised_name, ha_from_flags
from coordinator.cli.history import add_history_parser, run_history
from coordinator.cli.local import add_local_parser, run_local, split_script
from coordinator.cli.operator import add_drain_parsers, operator_call_failure, run_drain
from coordinator.cli.shard import add_shard_parser, run_shard
from coordinator.service.job_end import (
    already_complete,
    complete_message,
    read_completion,
    signal_exit_code,
    stopped_message,
)
from wire.cli_flags import (
    add_security_flags,
    add_version_flag,
    bundle_from_flags,
    configure_logging,
    quiet_grpc,
)
from wire.config_table import ConfigError, check_listen
from wire.identity import IdentityError


class StartError(Exception):
    """The coordinator cannot start; the message says why (raised with torch loaded)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coordinator", description="The isthmus coordinator.")
    add_version_flag(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the coordinator of a job")
    serve.add_argument("--config", required=True, help="the job's TOML config file")
    serve.add_argument("--listen", help="HOST:PORT to listen on (overrides server.listen)")
    serve.add_argument("--state-dir", help="state folder (overrides job.state_dir)")
    serve.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override a job.toml key, checked like the file (repeat for several)",
    )
    serve.add_argument("--crl", metavar="FILE", help="the CA's revocation list (reread live)")
    serve.add_argument(
        "--metrics",
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics on this port (127.0.0.1 unless HOST is given)",
    )
    serve.add_argument(
        "--status-page",
        metavar="[HOST:]PORT",
        help="serve a live, read-only status page (127.0.0.1 unless HOST is given; another "
        "address needs --tls-dir, then readers need an operator certificate, or "
        "--status-page-insecure)",
    )
    serve.add_argument(
        "--status-page-insecure",
        action="store_true",
        help="serve the status page off loopback over plain HTTP, without authentication",
    )
    add_security_flags(serve, "the coordinator")
    add_ha_flags(serve)
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    _add_status_parser(sub)
    add_export_parser(sub)
    add_local_parser(sub)
    add_certs_parser(sub)
    add_history_parser(sub)
    add_drain_parsers(sub)
    add_shard_parser(sub)
    return p


def _add_status_parser(sub) -> None:
    status = sub.add_parser("status", help="print the state of a running job")
    status.add_argument(
        "--coordinator",
        required=True,
        metavar="HOST:PORT[,HOST:PORT]",
        help="the coordinator; several (standby coordinators, `serve --ha`): the leader is found",
    )
    status.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    status.add_argument("--json", action="store_true", help="the reply as JSON")
    status.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="print it again every SECONDS (default 2) until Ctrl-C",
    )
    add_security_flags(status, "an operator")


def _serve(args) -> int:
    from coordinator.config import load_config
    from wire.objstore.config import check_storage

    if args.listen and (problem := check_listen(args.listen)):
        raise ConfigError(f"--listen {args.listen}: {problem}")
    if args.ha is not None:  # a malformed URL is refused before the config is even read
        from coordinator.ha.options import parse_ha_url

        parse_ha_url(args.ha)
    cfg = load_config(args.config, args.set)
    ha = ha_from_flags(args, cfg)
    check_storage(cfg.storage)  # credentials and endpoint, before the state folder is touched
    bundle = bundle_from_flags(args)
    _check_advertised(args, cfg, ha, bundle)
    page = _page_access(args, bundle)  # refused before the state folder is touched
    from coordinator.model_source import FactoryImportError, import_hint
    from coordinator.persist.local_store import StoreError
    from coordinator.service.server import (  # torch import: only for serve
        CoordinatorServer,
        ServerTls,
    )
    from strategies import StrategyError

    # Like `python -m`, make the working directory importable, so that model factories and
    # strategy plugins in the user's own project (`mypkg.model:build`) can be named.
    sys.path.insert(0, os.getcwd())
    if args.state_dir:
        cfg = dataclasses.replace(cfg, state_dir=Path(args.state_dir).absolute())
    done = read_completion(cfg.state_dir)
    if already_complete(done, cfg.name, cfg.rounds.total):
        print(complete_message(done))
        return 0
    try:
        tls = ServerTls(bundle, Path(args.crl) if args.crl else None) if bundle else None
        server = CoordinatorServer(cfg, args.listen, tls, ha, _shard_launch(args, cfg))
    except (StoreError, StrategyError) as exc:  # a wrong [strategy], state in use, damaged log
        raise StartError(str(exc)) from exc
    except FactoryImportError as exc:
        where = Path(args.config).resolve().parent
        hint = import_hint(exc.module, exc.missing, where, Path.cwd(), exc.key)
        raise StartError(f"{exc}; {hint}") from exc
    if ha is None:
        _serve_pages(args, server, cfg, bundle, page)
    else:  # they show the job's state: served once this coordinator leads
        server.on_lead.append(lambda: _serve_pages(args, server, cfg, bundle, page))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: server.stop(signum))
    code = server.run()
    if server.core is None:  # a standby stopped before it was elected, or one deposed
        return code if server.stopped_by is None else 0
    if server.stopped_by is not None:
        resume = shlex.join(["coordinator", "serve", "--config", args.config] + _resume_flags(args))
        rnd = server.core.state.round.number
        message = stopped_message(server.stopped_by, rnd, cfg.rounds.total, cfg.state_dir, resume)
        print(f"coordinator: {message}", file=sys.stderr)
        return signal_exit_code(server.stopped_by)
    if code == 0 and server.final is not None:
        print(f"job {cfg.name!r} complete; final model: {server.final.path}")
    return code


def _shard_launch(args, cfg):
    """How this coordinator starts shards 1..K-1 on its host: with its own flags."""
    from coordinator.shards.local import ShardLaunch

    return ShardLaunch(
        Path(args.config).absolute(),
        tuple(args.set),
        Path(cfg.state_dir).absolute(),
        "",
        Path(args.tls_dir).absolute() if args.tls_dir else None,
        Path(args.crl).absolute() if args.crl else None,
    )


def _check_advertised(args, cfg, ha, bundle) -> None:
    """With ``--ha`` over TLS: the name this coordinator advertises is in its certificate."""
    if ha is not None and bundle is not None:
        from coordinator.ha.options import advertised

        listen = args.listen or cfg.server.listen
        check_advertised_name(advertised(listen, listen, args.advertise), bundle.cert)


def _serve_pages(args, server, cfg, bundle, page) -> None:
    """``--metrics`` and ``--status-page`` of a server that is about to run."""
    from coordinator.persist.local_store import write_atomic
    from wire.net.metrics_http import MetricsAddressError, serve_metrics

    if args.metrics:
        try:
            _metrics, address = serve_metrics(server.metrics.registry, args.metrics)
        except (MetricsAddressError, OSError) as exc:
            server.close()
            raise StartError(f"--metrics {args.metrics}: {exc}") from exc
        write_atomic(cfg.state_dir / "metrics_address", f"{address}\n".encode())
    if page is not None:
        from coordinator.observe.status_page import start_status_page

        try:
            start_status_page(server.core, page, bundle, Path(args.crl) if args.crl else None)
        except OSError as exc:  # in use, or the bundle (ssl.SSLError is one)
            server.close()
            raise StartError(f"--status-page {args.status_page}: {exc}") from exc


def _page_access(args, bundle):
    """How ``--status-page`` is served (``coordinator.observe.page_access``), or None without it."""
    from coordinator.observe.page_access import INSECURE_FLAG, PageAccessError, page_access

    if args.status_page is None:
        if args.status_page_insecure:
            raise ConfigError(f"{INSECURE_FLAG} needs --status-page [HOST:]PORT")
        return None
    try:
        return page_access(
            args.status_page, tls=bundle is not None, insecure=args.status_page_insecure
        )
    except PageAccessError as exc:
        raise ConfigError(str(exc)) from None


def _resume_flags(args) -> list[str]:
    """The flags of this ``serve`` that a resume must repeat to find the same job."""
    flags = ["--state-dir", args.state_dir] if args.state_dir else []
    if args.ha:
        flags += ["--ha", args.ha] + (["--advertise", args.advertise] if args.advertise else [])
    return flags + [f for kv in args.set for f in ("--set", kv)]


def _status(args) -> int:
    from wire.net.leader import parse_addresses

    if problem := parse_addresses(args.coordinator)[1]:
        raise ConfigError(f"--coordinator {args.coordinator}: {problem}")
    import grpc

    from coordinator.observe.status import format_status, status_json
    from wire.proto import isthmus_pb2 as pb

    bundle = bundle_from_flags(args)
    while True:
        try:
            reply, _ = call_leader(
                args.coordinator,
                bundle,
                lambda stub: stub.Status(pb.StatusRequest(), timeout=args.timeout),
            )
        except grpc.RpcError as exc:
            failure = operator_call_failure(exc.isthmus_address, exc, bundle)
            print(f"coordinator: error: {failure}", file=sys.stderr)
            return 1
        text = status_json(reply) if args.json else format_status(reply)
        if args.watch is None:
            print(text)
            return 0
        if sys.stdout.isatty():
            print("\x1b[2J\x1b[H", end="")  # clear the screen, as `watch` does
        print(text, flush=True)
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def main(argv: list[str] | None = None) -> int:
    quiet_grpc()
    argv = list(sys.argv[1:] if argv is None else argv)
    script: list[str] = []
    if argv[:1] == ["local"]:
        argv, script = split_script(argv)
    args = _parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "INFO"))
    try:
        commands = {
            "certs": run_certs,
            "serve": _serve,
            "status": _status,
            "export": run_export,
            "local": lambda a: run_local(a, script),
            "history": run_history,
            "drain": run_drain,
            "undrain": run_drain,
            "shard": run_shard,
        }
        return commands[args.command](args)
    except (ConfigError, StartError, ExportError, IdentityError, OSError) as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
