"""The security flags every command that talks gRPC takes: ``--tls-dir`` or ``--insecure``.

Kept apart from ``wire.channel`` (which imports grpc): a command line is parsed, and its
``--help`` printed, before any gRPC module loads.
"""

from __future__ import annotations

import argparse
import sys

from wire.identity import Bundle, IdentityError

INSECURE_WARNING = (
    "WARNING: --insecure: plaintext gRPC with no authentication. Anyone who can reach the "
    "port can join as any site and read the model. Use only on a trusted, isolated network."
)


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
