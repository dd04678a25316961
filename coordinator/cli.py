"""``coordinator``: serve a job, or show the status of a running one."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path

import grpc

from coordinator.certs_cli import add_certs_parser, run_certs
from coordinator.config import ConfigError, load_config
from coordinator.history_cli import add_history_parser, run_history
from wire.channel import add_security_flags, bundle_from_flags, open_channel
from wire.identity import IdentityError


class StartError(Exception):
    """The coordinator cannot start; the message says why (raised with torch loaded)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coordinator", description="The isthmus coordinator.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the coordinator of a job")
    serve.add_argument("--config", required=True, help="the job's TOML config file")
    serve.add_argument("--listen", help="HOST:PORT to listen on (overrides server.listen)")
    serve.add_argument("--state-dir", help="state folder (overrides job.state_dir)")
    serve.add_argument("--crl", metavar="FILE", help="the CA's revocation list (reread live)")
    serve.add_argument(
        "--metrics",
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics on this port (127.0.0.1 unless HOST is given)",
    )
    add_security_flags(serve, "the coordinator")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    status = sub.add_parser("status", help="print the state of a running job")
    status.add_argument("--coordinator", required=True, metavar="HOST:PORT")
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
    add_certs_parser(sub)
    add_history_parser(sub)
    return p


def _serve(args) -> int:
    cfg = load_config(args.config)  # before the slow torch import: config errors come fast
    bundle = bundle_from_flags(args)
    from coordinator.server import CoordinatorServer, ServerTls  # torch import: only for serve
    from coordinator.store import StoreError, write_atomic
    from strategies import StrategyError
    from wire.metrics_http import MetricsAddressError, serve_metrics

    # Like `python -m`, make the working directory importable, so that model factories and
    # strategy plugins in the user's own project (`mypkg.model:build`) can be named.
    sys.path.insert(0, os.getcwd())
    if args.state_dir:
        cfg = dataclasses.replace(cfg, state_dir=Path(args.state_dir).absolute())
    try:
        tls = ServerTls(bundle, Path(args.crl) if args.crl else None) if bundle else None
        server = CoordinatorServer(cfg, args.listen, tls)
    except (StoreError, StrategyError) as exc:  # a wrong [strategy], state in use, damaged log
        raise StartError(str(exc)) from exc
    if args.metrics:
        try:
            metrics, address = serve_metrics(server.metrics.registry, args.metrics)
        except (MetricsAddressError, OSError) as exc:
            server.close()
            raise StartError(f"--metrics {args.metrics}: {exc}") from exc
        write_atomic(cfg.state_dir / "metrics_address", f"{address}\n".encode())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    return server.run()


def _status(args) -> int:
    from coordinator.status import format_status, status_json
    from wire.proto import isthmus_pb2 as pb
    from wire.proto import isthmus_pb2_grpc as pb_grpc

    with open_channel(args.coordinator, bundle_from_flags(args)) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        while True:
            try:
                reply = stub.Status(pb.StatusRequest(), timeout=args.timeout)
            except grpc.RpcError as exc:
                print(
                    f"coordinator: error: {_status_failure(args.coordinator, exc)}", file=sys.stderr
                )
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


def _status_failure(coordinator: str, exc: grpc.RpcError) -> str:
    hint = (
        exc.details()
        if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
        else "is `coordinator serve` running there, and do its TLS settings match?"
    )
    return f"no answer from {coordinator} ({exc.code().name}): {hint}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "certs":
            return run_certs(args)
        if args.command == "history":
            return run_history(args)
        return _serve(args) if args.command == "serve" else _status(args)
    except (ConfigError, StartError, IdentityError, OSError) as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
