"""Opening a channel to the coordinator: mutual TLS with the party's bundle, or plaintext
only when the caller explicitly chose ``--insecure``."""

from __future__ import annotations

import grpc

# Re-exported: the flags used to live here.
from wire.cli_flags import INSECURE_WARNING, add_security_flags, bundle_from_flags
from wire.identity import Bundle
from wire.net.grpc_options import channel_options

__all__ = ["INSECURE_WARNING", "add_security_flags", "bundle_from_flags", "open_channel"]


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
