"""``coordinator drain SITE`` and ``coordinator undrain SITE``: an operator's calls.

Drain takes a site out of the job: it finishes (in shared-data mode, hands back) its current
work, pushes what it owes and leaves, and is refused until undrained. Both need an operator's
certificate (``coordinator certs operator``) on a TLS job, as ``coordinator status`` does.
"""

from __future__ import annotations

import argparse
import sys

from wire.cli_flags import add_security_flags, bundle_from_flags
from wire.config_table import ConfigError
from wire.net.leader import parse_addresses


def add_drain_parsers(sub) -> None:
    for name, what in (
        ("drain", "take a site out of the job until undrained (it finishes its work first)"),
        ("undrain", "let a drained site join again"),
    ):
        p = sub.add_parser(name, help=what, description=what)
        p.add_argument("site", metavar="SITE", help="the site's name")
        p.add_argument("--coordinator", required=True, metavar="HOST:PORT[,HOST:PORT]")
        if name == "drain":
            p.add_argument("--reason", default="", help="shown in status and the event log")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
        add_security_flags(p, "an operator")


def run_drain(args: argparse.Namespace) -> int:
    """Send the call; print what the coordinator did (exit 0) or why it refused (exit 1)."""
    if problem := parse_addresses(args.coordinator)[1]:
        raise ConfigError(f"--coordinator {args.coordinator}: {problem}")
    import grpc

    from coordinator.cli.ha import call_leader
    from wire.proto import isthmus_pb2 as pb

    bundle = bundle_from_flags(args)
    request = pb.DrainRequest(
        site=args.site, undrain=args.command == "undrain", reason=getattr(args, "reason", "")
    )
    try:
        reply, _ = call_leader(
            args.coordinator, bundle, lambda stub: stub.Drain(request, timeout=args.timeout)
        )
    except grpc.RpcError as exc:
        failure = operator_call_failure(exc.isthmus_address, exc, bundle)
        print(f"coordinator: error: {failure}", file=sys.stderr)
        return 1
    print(reply.message)
    print(f"drained now: {', '.join(reply.drained) or 'none'}")
    return 0


def operator_call_failure(address: str, exc, bundle) -> str:
    """The one line a failed operator call (``exc``, a ``grpc.RpcError``) prints: refused, a
    TLS problem, or no answer."""
    import grpc

    from wire.net.tls_probe import diagnose, looks_like_tls

    code = exc.code()
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return f"{address} refused the call ({code.name}): {exc.details()}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return f"{address} refused the call: {exc.details()}"
    if code == grpc.StatusCode.UNAVAILABLE and (exc.details() or "").startswith("standby"):
        return f"{address} is a {exc.details()}"  # "standby; the leader is ..." (serve --ha)
    if code == grpc.StatusCode.UNAVAILABLE and bundle and looks_like_tls(exc.details()):
        problem = diagnose(address, bundle)
        if problem is not None:
            return f"cannot talk to {address}: {problem.message}"
    return (
        f"no answer from {address} ({code.name}): is `coordinator serve` running there, "
        "and do its TLS settings match?"
    )
