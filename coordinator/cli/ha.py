"""The command line of standby coordinators: ``serve --ha``'s flags, and operator calls that
find the leader among several coordinators (``--coordinator A:7070,B:7070``).

Only the standard library loads here (``--help`` and usage errors stay instant); grpc is
imported by the call that needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from wire.config_table import ConfigError, check_listen
from wire.net.leader import leader_named, next_address, parse_addresses

log = logging.getLogger("isthmus.coordinator")


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


def etcd_from_flags(args, cfg):
    """``--ha``, ``--advertise`` and ``--ha-ttl`` as job ``cfg``'s ``HaOptions`` (None
    without ``--ha``); ``ConfigError``. Shared by ``serve`` and ``shard``."""
    from coordinator.ha.options import ha_options

    if args.ha is None:
        if args.advertise:
            raise ConfigError("--advertise needs --ha etcd://HOST:PORT")
        return None
    if args.advertise and (problem := check_listen(args.advertise)):
        raise ConfigError(f"--advertise {args.advertise}: {problem}")
    opts = ha_options(args.ha, cfg.name, args.advertise or "", args.ha_ttl)
    try:
        import aetcd  # noqa: F401
    except ImportError:
        raise ConfigError("--ha needs aetcd: pip install 'isthmus[ha]'") from None
    return opts


def ha_from_flags(args, cfg):
    """``serve --ha`` and its flags as ``HaOptions`` (None without ``--ha``); ``ConfigError``."""
    opts = etcd_from_flags(args, cfg)
    if opts is None:
        return None
    if not cfg.storage.remote:
        raise ConfigError(
            '--ha needs [storage] url = "s3://BUCKET/PREFIX": the coordinator elected next '
            "loads the leader's checkpoints from there"
        )
    log.warning(ETCD_PLAINTEXT_WARNING)
    return opts


def check_advertised_name(address: str, cert_pem: bytes) -> None:
    """``ConfigError`` unless the host this coordinator is named by (``--advertise``, or its
    listen address) is a name of its certificate: sites that follow it there would fail TLS
    and fall back to the first address, again and again."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    from wire.net.tls_probe import cert_names, host_matches

    host = address.rpartition(":")[0].strip("[]")
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(Encoding.DER)
    names = cert_names(der)
    if not host_matches(host, names):
        raise ConfigError(
            f"--ha: this coordinator would be named {host!r}, which its certificate does not "
            f"hold (it holds {', '.join(names) or 'no names'}): sites following it would fail "
            "TLS; pass --advertise NAME:PORT with one of those names"
        )


# aetcd speaks to etcd only without TLS: what the election relies on must be private.
ETCD_PLAINTEXT_WARNING = (
    "--ha: the election reaches etcd without TLS or authentication: anyone who can reach etcd "
    "can depose the leader or stall the election (a deposed leader never commits, so the job "
    "waits, it does not fork). Keep etcd's client port on a network only the coordinators reach."
)


def call_leader(text: str, bundle, call: Callable, flag: str = "--coordinator"):
    """``call(stub)`` at the leading coordinator of ``text`` (one HOST:PORT, or several
    separated by commas); returns ``(reply, address)``.

    Each address is tried once, in order, and a standby's answer naming the leader is followed
    (a standby names it in every refusal, ``coordinator.ha.standby``). Raises the last
    ``grpc.RpcError`` with its address in ``exc.isthmus_address``; ``ConfigError`` for a
    malformed list.
    """
    import grpc

    from wire.net.channel import open_channel
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
