"""The command line of standby coordinators: ``serve --ha``'s flags, and operator calls that
find the leader among several coordinators (``--coordinator A:7070,B:7070``).

Only the standard library loads here (``--help`` and usage errors stay instant); grpc is
imported by the call that needs it.
"""

from __future__ import annotations

from collections.abc import Callable

from wire.config_table import ConfigError, check_listen
from wire.leader import leader_named, next_address, parse_addresses


def add_ha_flags(serve) -> None:
    serve.add_argument(
        "--ha",
        metavar="etcd://HOST:PORT[,HOST:PORT][/PREFIX]",
        help="run as one of several coordinators of the job (same config, [storage] in S3): "
        "the leader is elected through this etcd cluster, the others stand by",
    )
    serve.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="with --ha: the address sites and operators reach this coordinator at (default: "
        "the listen address; a wildcard host becomes this machine's name)",
    )
    serve.add_argument(
        "--ha-ttl",
        type=int,
        default=10,
        metavar="SECONDS",
        help="with --ha: the etcd lease TTL; a silent leader is replaced after about this "
        "long (default 10)",
    )


def ha_from_flags(args, cfg):
    """``--ha`` and its flags as ``HaOptions`` (None without ``--ha``); ``ConfigError``."""
    from coordinator.ha_options import ha_options

    if args.ha is None:
        if args.advertise:
            raise ConfigError("--advertise needs --ha etcd://HOST:PORT")
        return None
    if args.advertise and (problem := check_listen(args.advertise)):
        raise ConfigError(f"--advertise {args.advertise}: {problem}")
    opts = ha_options(args.ha, cfg.name, args.advertise or "", args.ha_ttl)
    if not cfg.storage.remote:
        raise ConfigError(
            '--ha needs [storage] url = "s3://BUCKET/PREFIX": the coordinator elected next '
            "loads the leader's checkpoints from there"
        )
    try:
        import aetcd  # noqa: F401
    except ImportError:
        raise ConfigError("--ha needs aetcd: pip install 'isthmus[ha]'") from None
    return opts


def call_leader(text: str, bundle, call: Callable, flag: str = "--coordinator"):
    """``call(stub)`` at the leading coordinator of ``text`` (one HOST:PORT, or several
    separated by commas); returns ``(reply, address)``.

    Each address is tried once, in order, and a standby's answer naming the leader is followed
    (a standby names it in every refusal, ``coordinator.standby``). Raises the last
    ``grpc.RpcError`` with its address in ``exc.isthmus_address``; ``ConfigError`` for a
    malformed list.
    """
    import grpc

    from wire.channel import open_channel
    from wire.proto import isthmus_pb2_grpc as pb_grpc

    addresses, problem = parse_addresses(text)
    if problem:
        raise ConfigError(f"{flag} {text}: {problem}")
    current, tried = addresses[0], []
    while True:
        tried.append(current)
        with open_channel(current, bundle) as channel:
            try:
                return call(pb_grpc.CoordinatorStub(channel)), current
            except grpc.RpcError as exc:
                exc.isthmus_address = current
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                named = leader_named(exc)
                nxt = next_address(addresses, current, named)
                if nxt in tried or len(tried) > len(addresses):
                    raise
                current = nxt
