"""gRPC channel and server settings for long rounds over a slow WAN.

grpc's default 4 MiB receive limit rejects even one 4 MiB chunk, so both ends set their limits
explicitly (a chunk plus its envelope, and a manifest for a model with many tensors). Keepalive
pings keep NAT and load-balancer state alive through rounds that are silent for minutes, and
BDP probing stays on where a window is not set: without it, and with gRPC's 64 KiB default
window, a long-RTT link loses most of its throughput. The coordinator sets its receive window
instead (``server.receive_window_bytes``): BDP probing on a busy server overestimates, and every
concurrent upload then holds tens of MiB.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 32 << 20

_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]


def channel_options() -> list[tuple[str, int]]:
    return [
        *_COMMON,
        ("grpc.http2.bdp_probe", 1),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
        # A connection of its own: clients in one process (tests, benchmarks) would otherwise
        # share one, and without TLS a connection is all that tells callers apart.
        ("grpc.use_local_subchannel_pool", 1),
        # Our own backoff (wire/backoff.py) paces retries; grpc's reconnect backoff (default
        # up to 120 s) would otherwise keep a channel down long after a WAN cut has healed.
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 4000),
    ]


def server_options(receive_window_bytes: int = 0) -> list[tuple[str, int]]:
    """``receive_window_bytes``: a fixed HTTP/2 window for what clients send (bounds the
    memory of each concurrent upload); 0 lets gRPC's BDP probing size it."""
    window = [("grpc.http2.bdp_probe", 1)]
    if receive_window_bytes:
        window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", receive_window_bytes)]
    return [
        *_COMMON,
        *window,
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]
