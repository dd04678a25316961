"""Where a process serves its Prometheus metrics: ``--metrics [HOST:]PORT``.

The endpoint is plain HTTP without authentication (as Prometheus scrapes it), so it binds to
loopback unless told otherwise, and a non-loopback address is served with a warning: anyone who
reaches it reads the job's state (site names, losses, bytes), though nothing can be changed.
"""

from __future__ import annotations

import ipaddress
import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("isthmus")


class MetricsAddressError(ValueError):
    """A ``--metrics`` value that is not ``[HOST:]PORT``."""


def parse_metrics_address(text: str) -> tuple[str, int]:
    """(host, port) from ``PORT`` (loopback) or ``HOST:PORT``; port 0 picks a free one."""
    return parse_http_address(text, "--metrics")


def parse_http_address(text: str, flag: str) -> tuple[str, int]:
    """``parse_metrics_address`` for any ``flag`` taking ``[HOST:]PORT`` (named in the error)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise MetricsAddressError(
            f"{flag} {text!r}: give PORT (served on 127.0.0.1) or HOST:PORT, e.g. 9100 or "
            "127.0.0.1:9100"
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_metrics(registry: CollectorRegistry, text: str) -> tuple[object, str]:
    """Serve ``registry`` on ``--metrics text``; returns (the HTTP server, its HOST:PORT)."""
    host, port = parse_metrics_address(text)
    if not is_loopback(host):
        log.warning(
            "metrics served on %s without authentication: anyone who reaches it reads the "
            "job's state; bind to 127.0.0.1 and scrape through a tunnel if that is not intended",
            host,
        )
    server, _thread = start_http_server(port, addr=host, registry=registry)
    address = f"{host}:{server.server_port}"
    log.info("metrics on http://%s/metrics", address)
    return server, address
