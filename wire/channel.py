"""Opening a channel to the coordinator: mutual TLS with the party's bundle, or plaintext
only when the caller explicitly chose ``--insecure``."""

from __future__ import annotations

import argparse
import sys

import grpc

from wire.grpc_options import channel_options
from wire.identity import Bundle, IdentityError

INSECURE_WARNING = (
    "WARNING: --insecure: plaintext gRPC with no authentication. Anyone who can reach the "
    "port can join as any site and read the model. Use only on a trusted, isolated network."
)


def open_channel(address: str, bundle: Bundle | None, own_connection: bool = False) -> grpc.Channel:
    """A channel to ``address``; ``own_connection``: never share its TCP connection with other
    channels (grpc pools them by default), so small calls on it do not queue behind a bulk
    transfer on another."""
    options = channel_options()
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if bundle is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(bundle.ca, bundle.key, bundle.cert)
    return grpc.secure_channel(address, creds, options=options)


def add_security_flags(parser: argparse.ArgumentParser, who: str) -> None:
    parser.add_argument(
        "--tls-dir",
        metavar="DIR",
        help=f"{who}'s TLS bundle (cert.pem, key.pem, ca.pem), from `coordinator certs`",
    )
    parser.add_argument(
        "--insecure", action="store_true", help="plaintext, unauthenticated (trusted networks)"
    )


def bundle_from_flags(args: argparse.Namespace) -> Bundle | None:
    """The bundle the flags name; ``None`` (with a warning) for ``--insecure``."""
    if args.insecure and args.tls_dir:
        raise IdentityError("choose one of --tls-dir and --insecure")
    if args.insecure:
        print(INSECURE_WARNING, file=sys.stderr)
        return None
    if not args.tls_dir:
        raise IdentityError(
            "mutual TLS is required: pass --tls-dir DIR (a bundle from `coordinator certs`), "
            "or --insecure for plaintext on a trusted network"
        )
    return Bundle.load(args.tls_dir)
