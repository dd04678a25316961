"""What every isthmus command line shares: ``--tls-dir`` or ``--insecure``, ``--version``,
flags that default to environment variables, gRPC's own log level, and the log handler that
shows isthmus's INFO lines and only third parties' warnings.

Kept apart from ``wire.net.channel`` (which imports grpc) and from torch: a command line is
parsed, and its ``--help`` printed, before either loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from importlib import metadata

from wire.identity import Bundle, IdentityError

TRUE = ("1", "true", "yes", "on")
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


def env_defaults(
    parser: argparse.ArgumentParser, table: Mapping[str, str], environ: Mapping[str, str]
) -> None:
    """Let each flag in ``table`` (flag -> variable) default to its environment variable, as
    torchrun's flags do to ``PET_*``: a flag on the command line wins, a required flag is not
    required when its variable is set, and a switch is on for ``1``, ``true``, ``yes``, ``on``.
    String values go through the flag's type like typed ones."""
    for action in parser._actions:  # argparse has no public list of a parser's arguments
        env = next((table[o] for o in action.option_strings if o in table), None)
        if env is None:
            continue
        action.help = f"{action.help or ''} [env {env}]".strip()
        if env not in environ:
            continue
        value = environ[env]
        action.default = value.strip().lower() in TRUE if action.nargs == 0 else value
        action.required = False


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")


def package_version() -> str:
    try:
        return metadata.version("isthmus")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def quiet_grpc() -> None:
    """gRPC's own INFO lines (each failed TLS handshake) would come before the one-line error
    a command prints; keep its errors. Read when grpc is first imported, so called first."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


# The loggers whose INFO lines are the product's own: ``isthmus.*``, and the modules of its
# packages that log under their own names (``coordinator.persist.local_store``).
OWN_LOGGERS = frozenset({"isthmus", "coordinator", "site_client", "strategies", "wire"})
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OwnInfoOnly(logging.Filter):
    """Lets through isthmus's own records at any level and everyone else's from WARNING up:
    a library's INFO line (``matplotlib.font_manager: generated new fontManager``,
    ``botocore.credentials: Found credentials``) is not news to the user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in OWN_LOGGERS


def configure_logging(level: str) -> None:
    """What ``logging.basicConfig(level=level)`` does, stderr and one format, with the handler
    filtered by ``OwnInfoOnly``; like basicConfig it leaves a process whose logging is
    already set up (handlers on the root logger) as it is."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(OwnInfoOnly())
    root.addHandler(handler)
    root.setLevel(level)
